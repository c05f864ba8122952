"""Benchmark: hidden-state extraction against a bare forward of the same target on the same tokens
(issue 13), HF and vLLM backends, before and after batching.

One run on the demo target (CPU), the same samples for every column (random ids, lengths drawn
from 16 to 400 tokens like the demo's responses):
  HF    bare       `model.model` forward on the padded batches extraction uses (by length): no hooks, no copies
        batched    `extract_with`, hidden_states.batch_tokens 4096 (this change)
        one        `extract_with`, one sequence per forward (before)
  vLLM  bare       the engine's generate(max_tokens=1) on the same prompts, no worker extension
        batched    `VllmStateExtractor`, several sequences per step (this change)
        one        the same with max_num_seqs=1 (before)
Each vLLM column has its own engine (they differ in engine arguments); engine start is excluded.
Prints a Markdown table of tokens/s and ratios to the bare forward of the same backend.

    .venv/bin/python bench/extraction.py
"""

import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NUM_SAMPLES = 96
VLLM = {"dtype": "float32", "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.2,
        "max_model_len": 512, "enforce_eager": True, "max_num_batched_tokens": 2048}


def samples_for(vocab_size):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 400, (NUM_SAMPLES,), generator=generator).tolist()
    return [{"id": f"b{i}", "input_ids": torch.randint(0, vocab_size, (n,), generator=generator).tolist(),
             "loss_mask": [0] + [1] * (n - 1)} for i, n in enumerate(lengths)]


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hf_columns(target, samples, out):
    from eaglenest.states.hf import BATCH_TOKENS, batches, extract_with, load_target, right_padded

    model = load_target(target, "float32", "cpu", trust_remote_code=False)

    @torch.no_grad()
    def bare():
        for batch in batches(sorted(samples, key=lambda s: len(s["input_ids"])), BATCH_TOKENS):  # as extract_with
            ids, mask = right_padded([torch.tensor(s["input_ids"]) for s in batch])
            model.model(input_ids=ids, attention_mask=mask, use_cache=False)

    return {
        "bare": timed(bare),
        "batched": timed(lambda: extract_with(model, samples, out / "hf_batched.safetensors", aux_layer_ids=None,
                                              dtype="float32", batch_tokens=BATCH_TOKENS)),
        "one": timed(lambda: extract_with(model, samples, out / "hf_one.safetensors", aux_layer_ids=None,
                                          dtype="float32", batch_tokens=1)),
    }


def vllm_columns(target, samples, out):
    from vllm import SamplingParams

    from eaglenest.engine.start import engine_args, start_engine, worker_environment
    from eaglenest.states.vllm_extract import VllmStateExtractor

    prompts = [{"prompt_token_ids": s["input_ids"]} for s in samples]
    with worker_environment():  # the same max_model_len + 1 as the extractor's engine
        llm = start_engine(target, engine_args(VLLM, trust_remote_code=False, max_model_len=VLLM["max_model_len"] + 1,
                                               enforce_eager=True))
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    seconds = {"bare": timed(lambda: llm.generate(prompts, params, use_tqdm=False))}
    llm.llm_engine.engine_core.shutdown()
    for name, settings in (("batched", VLLM), ("one", {**VLLM, "max_num_seqs": 1})):
        with VllmStateExtractor(target, aux_layer_ids=None, dtype="float32", vllm=settings,
                                trust_remote_code=False) as extractor:
            extractor.extract_shard(samples[:4], out / f"warm_{name}.safetensors")
            seconds[name] = timed(lambda: extractor.extract_shard(samples, out / f"vllm_{name}.safetensors"))
    return seconds


def main():
    from eaglenest.demo.target import build_demo_target
    from eaglenest.data.target import target_config

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        target = out / "target"
        build_demo_target(REPO / "resources/demo/corpus.jsonl", target, seed=0, steps=10, batch_size=8, seq_len=128)
        samples = samples_for(target_config(target)["vocab_size"])
        tokens = sum(len(s["input_ids"]) for s in samples)
        results = {"HF": hf_columns(target, samples, out), "vLLM": vllm_columns(target, samples, out)}
    print(f"demo target (8 layers, hidden 128), {len(samples)} samples, {tokens} tokens, one run, CPU\n")
    print("| backend | bare forward tok/s | batched extraction tok/s (ratio) | one per step tok/s (ratio) |")
    print("|---|---|---|---|")
    for backend, s in results.items():
        bare = tokens / s["bare"]
        print(f"| {backend} | {bare:,.0f} | {tokens / s['batched']:,.0f} ({s['bare'] / s['batched']:.2f}) "
              f"| {tokens / s['one']:,.0f} ({s['bare'] / s['one']:.2f}) |")


if __name__ == "__main__":
    main()
