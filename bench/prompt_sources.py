"""Benchmark: reading a 1 M-record Parquet mixture into prompts (the read_prompts stage), its time
and peak memory.

Writes two Parquet files of 500,000 records each, one ShareGPT ("conversations" of {from, value})
and one UltraChat ("messages" of {role, content}), each record a conversation of one to three
answered turns (a 300-character question, an 800-character answer), then runs
eaglenest.data.sources.read_sources on them as a 1:1 weighted mixture in a fresh process, and
reports its wall time, records per second and peak RSS (the process's ru_maxrss), with the
prompts it wrote. The figures go to BENCHMARKS.md "Reading prompt sources".

    .venv/bin/python bench/prompt_sources.py              # ~5 min on 2 cores, ~2.5 GB in a temp dir
    .venv/bin/python bench/prompt_sources.py --records 100000
"""

import argparse
import multiprocessing
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHUNK = 50_000  # records per Parquet row group written


def text(rng, n):
    return "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(n))


def conversation(rng, pool, i):
    """[(user, assistant)] turns of record i: 1 to 3, texts drawn from a pool (numbered: no two alike)."""
    return [(f"{i} {t} {rng.choice(pool[0])}", f"{rng.choice(pool[1])} {t}") for t in range(rng.randint(1, 3))]


def write_sources(folder, records):
    """Two Parquet files of records // 2 each: ShareGPT and UltraChat."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    pool = ([text(rng, 300) for _ in range(1000)], [text(rng, 800) for _ in range(1000)])
    paths = {"sharegpt": folder / "sharegpt.parquet", "ultrachat": folder / "ultrachat.parquet"}
    for name, path in paths.items():
        writer = None
        for start in range(0, records // 2, CHUNK):
            rows = []
            for i in range(start, min(start + CHUNK, records // 2)):
                turns = conversation(rng, pool, i)
                if name == "sharegpt":
                    rows.append({"id": f"sg-{i}", "conversations": [m for q, a in turns for m in (
                        {"from": "human", "value": q}, {"from": "gpt", "value": a})]})
                else:
                    rows.append({"prompt_id": f"{i:064x}", "messages": [m for q, a in turns for m in (
                        {"role": "user", "content": q}, {"role": "assistant", "content": a})]})
            table = pa.Table.from_pylist(rows)
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
        writer.close()
    return paths


def read(paths, out, queue):
    """In a fresh process: read_sources over the two files, 1:1, and what it cost."""
    from eaglenest.data.sources import read_sources

    start = time.perf_counter()
    counts = read_sources([{"path": str(paths["sharegpt"]), "weight": 1}, {"path": str(paths["ultrachat"]), "weight": 1}],
                          out / "prompts.jsonl", out / "sources.json", mix_seed=0)
    queue.put((time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, counts))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO) as folder:
        folder = Path(folder)
        start = time.perf_counter()
        paths = write_sources(folder, args.records)
        sizes = {name: path.stat().st_size for name, path in paths.items()}
        print(f"wrote {args.records:,} records in {time.perf_counter() - start:.0f} s: "
              + ", ".join(f"{name} {size / 1e6:.0f} MB" for name, size in sizes.items()), flush=True)
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=read, args=(paths, folder, queue))
        child.start()
        seconds, peak, counts = queue.get()
        child.join()
        prompts_mb = (folder / "prompts.jsonl").stat().st_size / 1e6
        print(f"| records | Parquet MB | seconds | records/s | peak RSS MB | prompts | prompts MB |")
        print(f"|---|---|---|---|---|---|---|")
        print(f"| {args.records:,} | {sum(sizes.values()) / 1e6:,.0f} | {seconds:,.0f} | {args.records / seconds:,.0f} | "
              f"{peak / 2**20:,.0f} | {counts['prompts']:,} | {prompts_mb:,.0f} |")


if __name__ == "__main__":
    main()
