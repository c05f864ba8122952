"""Benchmark: how long Snakemake takes to decide that nothing (or something) is stale, at scale.

Two copies of the workflow on the same 10,000 samples, measured side by side: one with 1,000
shards, one with the demo's 4. Both are built completely first; then each measurement alternates
between the two copies, REPEATS times, so that both columns see the same machine:
  dry run    `snakemake -n` with everything up to date
  no-op run  `snakemake --cores 2` with everything up to date
  append     dry run after one sample is appended, after `snakemake shard_samples` (exact plan)
The 1,000 shard files are extracted in one process (a Snakemake job per shard costs an
interpreter start and a torch import: ~50 min on 2 cores) and then registered with
`snakemake --touch`, which records Snakemake's metadata exactly as a run does; every other stage
runs as usual. Targets (issue 4): dry run < 5 s, no-op < 10 s on 2 cores.

With --against REV the two copies both have 1,000 shards: one runs this checkout's code, the other
the same results with git revision REV's workflow code swapped in (registered with `snakemake
--touch`). That compares the cost of deciding staleness before and after a change that writes the
same artifacts, such as a refactor.

    .venv/bin/python bench/incremental.py                 # prints a Markdown table
    .venv/bin/python bench/incremental.py --against REV   # this code against REV's, 1,000 shards
"""

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from conftest import edit_config, new_workdir  # noqa: E402  (the tests' workflow copy, reused)
from eaglenest.states.hf import extract_with, load_target  # noqa: E402
from eaglenest.states.parts import part_paths, read_part  # noqa: E402

SAMPLES = 10_000
REPEATS = 5
CODE = ["Snakefile", "rules", "scripts", "schemas", "eaglenest"]  # what --against swaps
BENCH_CONFIG = {  # small everywhere except the sample and shard counts under test
    "data": {"raw_responses": "resources/bench_responses.jsonl"},
    "train": {"epochs": 1},
    "eval": {"max_tokens": 32, "max_prompts": 16},
}


def snakemake(workdir, *args):
    result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=workdir, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"snakemake {args} failed in {workdir}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def timed(workdir, *args):
    """Wall time of one snakemake run with `args`, and its output."""
    start = time.monotonic()
    result = snakemake(workdir, *args)
    return time.monotonic() - start, result.stdout + result.stderr


def bench_responses(workdir):
    """SAMPLES response records: the demo's hand-written ones, cycled under new ids."""
    demo = (REPO / "resources/demo/raw_responses.jsonl").read_text().splitlines()
    with open(workdir / BENCH_CONFIG["data"]["raw_responses"], "w") as out:
        for i in range(SAMPLES):
            out.write(json.dumps(json.loads(demo[i % len(demo)]) | {"id": f"bench-{i:05d}"}) + "\n")


def extract_in_one_process(workdir, num_shards):
    """What the hidden_states jobs would write, with the target loaded once."""
    results = workdir / "results"
    model = load_target(results / "target", "float32", "cpu", trust_remote_code=False)
    for shard in range(num_shards):
        part, _ = part_paths(results / "data/shards", shard)
        shard_path = results / f"hidden_states/shard_{shard:05d}.safetensors"
        extract_with(model, read_part(part), shard_path, aux_layer_ids=None, dtype="float32")


def build(root, num_shards):
    workdir = new_workdir(root)
    edit_config(workdir, BENCH_CONFIG | {"hidden_states": {"num_shards": num_shards}})
    bench_responses(workdir)
    snakemake(workdir, "shard_samples")
    extract_in_one_process(workdir, num_shards)
    snakemake(workdir, "--touch", "--forcerun", "hidden_states", "--allowed-rules", "hidden_states")
    snakemake(workdir)
    return workdir


def with_code_of(rev, workdir, copy):
    """A copy of the built `workdir` running revision `rev`'s workflow code, its results registered
    as up to date for that code."""
    shutil.copytree(workdir, copy, symlinks=True)
    for name in CODE:
        shutil.rmtree(copy / name) if (copy / name).is_dir() else (copy / name).unlink()
    archive = subprocess.run(["git", "archive", rev, *CODE], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(copy, filter="tar")
    shutil.rmtree(copy / ".snakemake/eaglenest", ignore_errors=True)  # the module-summary cache
    snakemake(copy, "--touch")
    return copy


def measure(workdirs):
    """{label: {figure: seconds (medians) or count}} for the built copies in `workdirs`."""
    times = {n: {"dry": [], "noop": [], "append_dry": []} for n in workdirs}
    for _ in range(REPEATS):
        for args, key in [(["-n"], "dry"), ([], "noop")]:
            for n, workdir in workdirs.items():
                seconds, output = timed(workdir, *args)
                assert "Nothing to be done" in output, output[-2000:]
                times[n][key].append(seconds)
    planned = {}
    for n, workdir in workdirs.items():
        raw = workdir / BENCH_CONFIG["data"]["raw_responses"]
        first = json.loads(raw.read_text().splitlines()[0])
        with open(raw, "a") as out:
            out.write(json.dumps(first | {"id": "bench-appended"}) + "\n")
        snakemake(workdir, "shard_samples")
    for _ in range(REPEATS):
        for n, workdir in workdirs.items():
            seconds, output = timed(workdir, "-n")
            times[n]["append_dry"].append(seconds)
            planned[n] = output.count("rule hidden_states:")
    return {n: {key: statistics.median(values) for key, values in figures.items()} | {"shards_planned": planned[n]}
            for n, figures in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", metavar="REV", help="compare with git revision REV's code, both at 1,000 shards")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        workdirs = {}
        for num_shards in (1000,) if args.against else (1000, 4):
            root = Path(tmp) / f"shards{num_shards}"
            root.mkdir()
            start = time.monotonic()
            workdirs[num_shards] = build(root, num_shards)
            print(f"built {num_shards} shards in {time.monotonic() - start:.0f} s", file=sys.stderr)
        if args.against:
            workdirs[args.against] = with_code_of(args.against, workdirs[1000], Path(tmp) / "against")
        figures = measure(workdirs)
    first, second = figures.values()
    columns = ["this code", args.against] if args.against else ["1,000 shards", "4 shards"]
    print(f"| {SAMPLES:,} samples, medians of {REPEATS} | {columns[0]} | {columns[1]} | ratio |")
    print("|---|---|---|---|")
    for key, label in [("dry", "`snakemake -n`, all up to date"), ("noop", "`snakemake`, all up to date (no-op)"),
                       ("append_dry", "`snakemake -n` after appending one sample (split done)")]:
        print(f"| {label} | {first[key]:.2f} s | {second[key]:.2f} s | {first[key] / second[key]:.2f}x |")
    print(f"| shards planned after the append | {first['shards_planned']} | {second['shards_planned']} | |")


if __name__ == "__main__":
    main()
