"""Benchmark: the two drafter layers side by side on one Kimi-shaped run, each through the whole
workflow's training, export, pre-flight and evaluation (offline and in vLLM).

After `make demo-kimi` (results/kimi), each layer variant gets a copy of that run made of hard
links (results/kimi-layers/<variant>/: the same target, responses, tokens, vocab, shards,
baseline text and agreement states, byte for byte, no disk spent) and Snakemake reruns
`train_drafter` and what follows it there with the variant's `drafter:` settings
(`--forcerun train_drafter`: a copied output has no Snakemake metadata, so a changed setting
alone would rerun nothing). Every atomic write replaces a link by a new file, so the run it was
copied from is never touched. Then one table: for each variant, at every suite, temperature and
concurrency of the grid, the draft method and K that serve best, acceptance per position, mean
acceptance length, speed-up, and whether vLLM agreed with the offline estimate.

    .venv/bin/python bench/drafter_layers.py                  # every VARIANTS entry
    .venv/bin/python bench/drafter_layers.py --variants gqa,mla
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/kimi.yaml"
SOURCE = REPO / "results/kimi"
OUT = REPO / "results/kimi-layers"
# drafter: settings over configs/kimi.yaml's. vLLM's Eagle3DeepseekV2ForCausalLM has no input_norm
# over the aux states, so mla runs without norm_before_fc; gqa_same_flags isolates the layer.
VARIANTS = {
    "gqa": {"layer": "gqa", "norm_before_fc": True},
    "gqa_same_flags": {"layer": "gqa", "norm_before_fc": False},
    "mla": {"layer": "mla", "norm_before_fc": False},
}


def linked_copy(source, dest):
    """`source`'s tree as hard links under `dest` (file times kept, so Snakemake sees nothing new)."""
    shutil.copytree(source, dest, copy_function=os.link)


def run_variant(name, cores):
    """Train and evaluate one variant in its linked copy (unless its summary exists) -> its vllm_metrics."""
    dest = OUT / name
    if not (dest / "summary.md").exists():
        shutil.rmtree(dest, ignore_errors=True)
        linked_copy(SOURCE, dest)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as overlay:
            yaml.safe_dump({"results": str(dest.relative_to(REPO)), "drafter": VARIANTS[name]}, overlay)
        subprocess.run([str(Path(sys.executable).with_name("snakemake")), "--cores", str(cores),
                        "--configfile", str(CONFIG), overlay.name, "--forcerun", "train_drafter"],
                       cwd=REPO, check=True)
        os.unlink(overlay.name)
    return json.loads((dest / "eval/vllm_metrics.json").read_text())


def table(metrics):
    print("| layer | suite | T | c | method, K | acceptance per position | mean acceptance length | speed-up "
          "| offline = vLLM |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in metrics.items():
        agree = {(r["suite"], r["temperature"], r["concurrency"], r["draft_sample_method"],
                  r["num_speculative_tokens"]): r["agrees"] for r in m["runs"]}
        for best in m["recommended"]:
            key = (best["suite"], best["temperature"], best["concurrency"], best["draft_sample_method"],
                   best["num_speculative_tokens"])
            rates = " / ".join(f"{a:.2f}" for a in best["acceptance_rate_per_position"])
            print(f"| {name} | {best['suite']} | {best['temperature']:g} | {best['concurrency']} "
                  f"| {best['draft_sample_method']}, {best['num_speculative_tokens']} | {rates} "
                  f"| {best['mean_acceptance_length']:.2f} | {best['speedup']:.2f}x | {agree[key]} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    if not (SOURCE / "summary.md").is_file():
        sys.exit("results/kimi is not a finished run: run `make demo-kimi` first")
    table({name: run_variant(name, args.cores) for name in args.variants.split(",")})


if __name__ == "__main__":
    main()
