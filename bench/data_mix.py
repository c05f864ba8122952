"""Benchmark: the temperatures the training data is drawn at, against acceptance and its ceiling.

The demo workflow runs once per mix of generate.temperatures and generate.samples_per_prompt,
each into its own results folder (results/data_mix/<mix>), on the demo target an earlier
`make demo` built (target.path: results/target, so every mix drafts for the same target), to
its vLLM evaluation. All else is the demo's config (its recipe and draft methods: greedy, and
probabilistic above temperature 0), but the grid is cut to K = 3 at CONCURRENCY
requests at once, the demo's largest, where every held-out prompt runs (one drafter engine a mix). The held-out split goes by prompt, so every mix is evaluated
on the same held-out prompts, and the baseline texts (seeded by suite and prompt) are the same
too: the mixes differ only in what the drafter learned from. Per mix: answers, training tokens,
generation and training time (Snakemake's benchmark files: generate_part jobs summed, as they
share one engine), then per suite and temperature vLLM's acceptance per position, the ceiling
and the share of it, and the mean acceptance length.

    .venv/bin/python bench/data_mix.py                  # after make demo; 5 to 12 min a mix on 2 cores
    .venv/bin/python bench/data_mix.py --mixes greedy,t1  # a subset of MIXES
"""

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MIXES = {  # name: (generate.temperatures, generate.samples_per_prompt)
    "greedy": ([0.0], 1),
    "t1": ([1.0], 1),
    "t1_n2": ([1.0], 2),
    "t1_n4": ([1.0], 4),
    "both": ([0.0, 1.0], 1),
    "both_n2": ([0.0, 1.0], 2),
}
CONCURRENCY = 4  # the demo's largest: every prompt of each suite runs at it (eval.max_prompts: null)


def seconds(benchmark_files):
    return sum(float(next(csv.DictReader(open(f), delimiter="\t"))["s"]) for f in benchmark_files)


def run_mix(name, temperatures, samples_per_prompt, cores):
    """The demo workflow to its vLLM evaluation with this mix's data, in results/data_mix/<name>."""
    results = f"results/data_mix/{name}"
    overlay = {"results": results, "target": {"demo": False, "path": "results/target"},
               "generate": {"temperatures": temperatures, "samples_per_prompt": samples_per_prompt},
               "eval": {"num_speculative_tokens": [3], "concurrency": [CONCURRENCY]}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(overlay, f)
    subprocess.run([sys.executable, "-m", "snakemake", f"{results}/eval/vllm_metrics.json", "--cores", str(cores),
                    "--configfile", "config.yaml", f.name], cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def collect(name, temperatures, samples_per_prompt):
    """One mix's figures from its results folder."""
    root = REPO / f"results/data_mix/{name}"
    report = json.loads((root / "data/tokenize_report.json").read_text())
    metrics = json.loads((root / "eval/vllm_metrics.json").read_text())
    return {"mix": name, "temperatures": temperatures, "n": samples_per_prompt, "answers": report["samples_out"],
            "generated_tokens": report["generated_tokens"],
            "generate_s": seconds((root / "benchmarks/generate").glob("part_*.tsv")),
            "train_s": seconds([root / "benchmarks/train_drafter.tsv"]), "runs": metrics["runs"]}


def rates(values, digits=2):
    return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", default=",".join(MIXES), help="names of MIXES, comma-separated")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--table-only", action="store_true", help="tabulate mixes already run, run nothing")
    args = parser.parse_args()
    if not (REPO / "results/target/config.json").is_file():
        sys.exit("results/target is missing: run `make demo` first")
    rows = []
    for name in args.mixes.split(","):
        if not args.table_only:
            run_mix(name, *MIXES[name], args.cores)
            print(f"{name} done", file=sys.stderr, flush=True)
        rows.append(collect(name, *MIXES[name]))
    print("| data | answers | generated tokens | generation | training | suite | T | draft method "
          "| acceptance (vLLM, K=3) | ceiling (of the method) | share of ceiling | mean acceptance length |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        data = f"T {', '.join(f'{t:g}' for t in row['temperatures'])}, n={row['n']}"
        runs = [r for r in row["runs"] if r["num_speculative_tokens"] == 3 and r["concurrency"] == CONCURRENCY]
        for run in sorted(runs, key=lambda r: (r["suite"] != "heldout", r["suite"], r["temperature"],
                                               r["draft_sample_method"])):
            print(f"| {data} | {row['answers']:,} | {row['generated_tokens']:,} | {row['generate_s']:.0f} s "
                  f"| {row['train_s']:.0f} s | {run['suite']} | {run['temperature']:g} | {run['draft_sample_method']} "
                  f"| {rates(run['acceptance_rate_per_position'])} | {rates(run['ceiling_per_position'])} "
                  f"| {rates(run['share_of_ceiling_per_position'])} | {run['mean_acceptance_length']:.2f} |")


if __name__ == "__main__":
    main()
