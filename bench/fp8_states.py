"""Benchmark: hidden states stored in bfloat16 against float8_e4m3fn, side by side in one run.

The demo workflow runs once per storage dtype, each into its own results folder
(results/fp8/<dtype>), from the same target and the same responses (those of an earlier
`make demo`: target.path results/target, data.raw_responses its raw_responses.jsonl), with the
same seed and steps, to its vLLM evaluation at K = 3, one request at once, at temperatures 0 and 1.
Both compute the states in bfloat16 (the HF backend's dtype for FP8, docs/CONVENTIONS.md), so
they differ by the quantization alone. Per dtype: bytes per token (plan.json), shard bytes on
disk, extraction and training time (Snakemake's benchmark files), then per suite and temperature
vLLM's acceptance per position and mean acceptance length, and the offline estimate on the
held-out shards.

    .venv/bin/python bench/fp8_states.py      # after make demo; ~5 min a dtype on 2 cores
    .venv/bin/python bench/fp8_states.py --max-prompts 200   # then: the same drafters on more prompts
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from data_mix import rates, seconds

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("bfloat16", "float8_e4m3fn")


def run(dtype, cores, max_prompts):
    results = f"results/fp8/{dtype}"
    overlay = {"results": results, "target": {"demo": False, "path": "results/target"},
               "data": {"raw_responses": "results/responses/raw_responses.jsonl"},
               "hidden_states": {"dtype": dtype}, "eval": {"num_speculative_tokens": [3], "concurrency": [1]}}
    if max_prompts:  # more prompts a suite: only the evaluation reruns, on the same drafters
        overlay["eval"] |= {"max_prompts": max_prompts, "concurrency": [4]}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(overlay, f)
    subprocess.run([sys.executable, "-m", "snakemake", f"{results}/plan.json", f"{results}/eval/vllm_metrics.json",
                    f"{results}/eval/offline_metrics.json", "--cores", str(cores), "--configfile", "config.yaml",
                    f.name], cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def collect(dtype):
    root = REPO / f"results/fp8/{dtype}"
    plan = json.loads((root / "plan.json").read_text())
    return {"dtype": dtype, "bytes_per_token": plan["hidden_states_bytes_per_token"],
            "shard_bytes": sum(p.stat().st_size for p in (root / "hidden_states").glob("shard_*.safetensors")),
            "extract_s": seconds((root / "benchmarks/hidden_states").glob("shard_*.tsv")),
            "train_s": seconds([root / "benchmarks/train_drafter.tsv"]),
            "offline": json.loads((root / "eval/offline_metrics.json").read_text()),
            "runs": json.loads((root / "eval/vllm_metrics.json").read_text())["runs"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--table-only", action="store_true", help="tabulate runs already made, run nothing")
    parser.add_argument("--max-prompts", type=int, default=None,
                        help="eval.max_prompts (the demo's 8 by default), at 4 requests at once")
    args = parser.parse_args()
    for needed in ("results/target/config.json", "results/responses/raw_responses.jsonl"):
        if not (REPO / needed).is_file():
            sys.exit(f"{needed} is missing: run `make demo` first")
    rows = []
    for dtype in DTYPES:
        if not args.table_only:
            run(dtype, args.cores, args.max_prompts)
            print(f"{dtype} done", file=sys.stderr, flush=True)
        rows.append(collect(dtype))
    base = rows[0]
    print("| stored as | bytes per token | shard bytes (of bf16) | extraction | training | offline held-out K=3 "
          "| suite | T | acceptance (vLLM, K=3) | mean acceptance length |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        offline = row["offline"]["served"]
        for r in sorted(row["runs"], key=lambda r: (r["suite"] != "heldout", r["suite"], r["temperature"])):
            print(f"| {row['dtype']} | {row['bytes_per_token']:,} | {row['shard_bytes']:,} "
                  f"({row['shard_bytes'] / base['shard_bytes']:.3f}) | {row['extract_s']:.0f} s | {row['train_s']:.0f} s "
                  f"| {rates(offline['acceptance_rate_per_position'])} ({offline['mean_acceptance_length']:.2f}) "
                  f"| {r['suite']} | {r['temperature']:g} | {rates(r['acceptance_rate_per_position'])} "
                  f"| {r['mean_acceptance_length']:.2f} |")


if __name__ == "__main__":
    main()
