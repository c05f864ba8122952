"""Benchmark: the two drafter layers side by side on one Kimi-shaped run: both trained on the same
shards by the workflow, each measured offline, and in real vLLM where vLLM starts it.

After `make demo-kimi` (results/kimi, whose drafter has the layer configs/kimi.yaml resolves: mla
on the MLA target), the other layer gets a copy of that run made of hard links
(results/kimi-layers/<layer>/: the same target, responses, tokens, vocab, shards, baseline text
and agreement states, byte for byte, no disk spent), and Snakemake reruns `train_drafter` and
what follows it there with `drafter.layer` set (`--forcerun train_drafter`: a copied output has
no Snakemake metadata, so a changed setting alone would rerun nothing). Every atomic write
replaces a link by a new file: the run it was copied from is never touched. Where vLLM cannot
start the layer's drafter engines beside this target on this machine (the engine-start check,
asked in-process with the layer set), the copy stops at the offline evaluation and the table says
why. Then one table: each layer's offline acceptance (K = the offline evaluation's) and, per
suite, temperature and concurrency, the draft method and K that serve best in vLLM with
acceptance per position, mean acceptance length, speed-up and whether vLLM agreed with the offline
estimate.

    .venv/bin/python bench/drafter_layers.py
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
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs/kimi.yaml"
SOURCE = REPO / "results/kimi"
OUT = REPO / "results/kimi-layers"
LAYERS = ("gqa", "mla")


def config():
    """configs/kimi.yaml over config.yaml, as Snakemake merges them."""
    base = yaml.safe_load((REPO / "config.yaml").read_text())
    for key, value in yaml.safe_load(CONFIG.read_text()).items():
        base[key] = base[key] | value if isinstance(value, dict) else value
    return base


def start_problem(layer):
    """Why vLLM would not start the drafter engines of `layer` beside the run's target, or None."""
    from eaglenest.plan.engine_start import check_engine_start
    from eaglenest.workflow.errors import InputError
    vllm = config()["vllm"]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            check_engine_start(SOURCE / "target", Path(tmp) / "check.json", dtype=vllm["dtype"],
                               kv_cache_dtype=vllm["kv_cache_dtype"], attention_backend=vllm["attention_backend"],
                               drafter_layer=layer)
        except InputError as e:
            return str(e)
    return None


def run_layer(layer, cores):
    """The run of `layer`: results/kimi where its drafter has that layer, else a linked copy trained
    and evaluated with it -> (run folder, why vLLM does not start it or None)."""
    trained = json.loads((SOURCE / "train/drafter_config.json").read_text()).get("layer", "gqa")
    problem = start_problem(layer)
    if trained == layer:
        return SOURCE, problem
    dest = OUT / layer
    done = dest / ("eval/offline_metrics.json" if problem else "summary.md")
    if not done.exists():
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(SOURCE, dest, copy_function=os.link)
        overlay = dest / "layer.yaml"
        overlay.write_text(yaml.safe_dump({"results": str(dest.relative_to(REPO)), "drafter": {"layer": layer}}))
        targets = [str(done.relative_to(REPO))] if problem else []
        subprocess.run([str(Path(sys.executable).with_name("snakemake")), "--cores", str(cores), "--configfile",
                        str(CONFIG), str(overlay), "--forcerun", "train_drafter", *targets], cwd=REPO, check=True)
    return dest, problem


def rates(acceptance):
    return " / ".join(f"{a:.2f}" for a in acceptance["acceptance_rate_per_position"])


def table(runs):
    print("| layer | measured | suite | T | c | method, K | acceptance per position | mean acceptance length "
          "| speed-up | offline = vLLM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layer, (folder, problem) in runs.items():
        offline = json.loads((folder / "eval/offline_metrics.json").read_text())
        print(f"| {layer} | offline, held-out shards | | 0 | | greedy, {offline['num_speculative_tokens']} "
              f"| {rates(offline)} | {offline['mean_acceptance_length']:.2f} | | |")
        if problem:
            print(f"| {layer} | vLLM: does not start | {problem} | | | | | | | |")
            continue
        metrics = json.loads((folder / "eval/vllm_metrics.json").read_text())
        agrees = {(r["suite"], r["temperature"], r["concurrency"], r["draft_sample_method"],
                   r["num_speculative_tokens"]): r["agrees"] for r in metrics["runs"]}
        for best in metrics["recommended"]:
            key = (best["suite"], best["temperature"], best["concurrency"], best["draft_sample_method"],
                   best["num_speculative_tokens"])
            print(f"| {layer} | vLLM | {best['suite']} | {best['temperature']:g} | {best['concurrency']} "
                  f"| {best['draft_sample_method']}, {best['num_speculative_tokens']} | {rates(best)} "
                  f"| {best['mean_acceptance_length']:.2f} | {best['speedup']:.2f}x | {agrees[key]} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    if not (SOURCE / "summary.md").is_file():
        sys.exit("results/kimi is not a finished run: run `make demo-kimi` first")
    table({layer: run_layer(layer, args.cores) for layer in LAYERS})


if __name__ == "__main__":
    main()
