# Whether vLLM can start the target with the drafter at all (the attention backends vLLM picks for
# the target's layers and the drafter's share a KV cache block size, and take the dtype), from the
# target's config.json and the settings alone: eaglenest/plan/engine_start.py. It gates the first
# stages of the hours (split_prompts before generation, shard_samples before extraction,
# vllm_baseline before evaluation) so that a drafter engine that cannot start fails the run
# before them, not after. A checkpoint, read through engine_start_passed: when it reruns (a
# setting or its code changed) and writes the same bytes, Snakemake re-decides its dependents
# after it, compares the checksum of the small file and reruns none of them (a dry run, which
# cannot know the bytes beforehand, lists them as it lists split_prompts' parts).


checkpoint engine_start_check:
    input:
        target=TARGET,
    output:
        check=f"{RESULTS}/engine_start_check.json",
    params:
        # what defines the engines' artifacts; vllm.attention_backend, a speed setting that reruns
        # nothing (docs/REBUILDING.md), is read from the config when the check runs
        dtype=config["vllm"]["dtype"],
        kv_cache_dtype=config["vllm"]["kv_cache_dtype"],
        drafter_layer=config["drafter"].get("layer"),  # null: gqa (Llama attention)
        drafter_head_dim=config["drafter"]["head_dim"],
        code=code("engine_start_check"),
    log:
        f"{RESULTS}/logs/engine_start_check.log",
    priority: 100
    resources:
        gpu=1,  # vLLM's platform (CUDA: the device's compute capability) decides its backends
    conda:
        ENV
    script:
        "../scripts/engine_start_check.py"


def engine_start_passed(wildcards):
    """Input of the stages the check gates: its verdict, once the checkpoint has run."""
    return checkpoints.engine_start_check.get().output.check
