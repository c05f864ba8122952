"""Benchmark: what the plan costs at Kimi-K2.5's size, against a bare JSON parse of the same file.

The plan reads tokenized_data.jsonl once (eaglenest.plan.plan.sample_counts: each sample's
length, generated tokens and shard). This writes a synthetic file of the seed's size, 10,000
samples of 2,100 tokens (21 M tokens, ids drawn from Kimi's 163,840), and times, side by side:
  bare     json.loads of every line, nothing else (the floor of any reader of this file)
  plan     sample_counts over it, 256 shards as README's Kimi config
The plan's limit: negligible against the extraction it plans (the seed's 3.8 h).

    .venv/bin/python bench/plan.py     # ~1 min on 2 cores, 217 MB in a temp dir
"""

import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.plan.plan import sample_counts  # noqa: E402

SAMPLES, TOKENS, PROMPT, VOCAB, SHARDS = 10_000, 2_100, 300, 163_840, 256
EXTRACTION_S = 3.8 * 3600  # the seed's extraction of these 21 M tokens on 8 GPUs


def write_file(path):
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(SAMPLES):
            ids = [rng.randrange(VOCAB) for _ in range(TOKENS)]
            f.write(json.dumps({"id": f"sample-{i}", "input_ids": ids,
                                "loss_mask": [0] * PROMPT + [1] * (TOKENS - PROMPT)}) + "\n")


def bare(path):
    with open(path) as f:
        for line in f:
            json.loads(line)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenized_data.jsonl"
        write_file(path)
        timings = {}
        for name, run in [("bare", lambda: bare(path)), ("plan", lambda: sample_counts(path, SHARDS, 0.02))]:
            start = time.perf_counter()
            run()
            timings[name] = time.perf_counter() - start
        size = path.stat().st_size
    print(f"{SAMPLES:,} samples x {TOKENS:,} tokens ({size / 1e6:.0f} MB):")
    print("| reader | seconds | vs bare parse | vs the seed's extraction (3.8 h) |")
    print("|---|---|---|---|")
    for name, seconds in timings.items():
        print(f"| {name} | {seconds:.1f} | {seconds / timings['bare']:.2f} | {seconds / EXTRACTION_S:.5f} |")


if __name__ == "__main__":
    main()
