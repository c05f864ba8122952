# Whether vLLM can start the target with the drafter at all (the attention backends vLLM picks for
# the target's layers and the drafter's share a KV cache block size, and take the dtype), from the
# target's config.json and the settings alone: eaglenest/plan/engine_start.py. It gates the first
# stages of the hours (generate_part, shard_samples before extraction,
# vllm_baseline before evaluation), so that drafter engines that cannot start fail the run before
# them, not after.
#
# Everything downstream of a remade file is remade (docs/SNAKEMAKE.md, "ancient() drops jobs"), so
# it reruns only with what remakes generation anyway: the target and the engine's dtypes. The
# drafter layer and geometry and vllm.attention_backend (a speed setting) are read from the config
# when it runs, and its code is not a param: changing them rebuilds nothing (and checks nothing
# again: after such a change, `snakemake --forcerun engine_start_check --until engine_start_check`).


rule engine_start_check:
    input:
        target=TARGET,
    output:
        check=f"{RESULTS}/engine_start_check.json",
    params:
        dtype=config["vllm"]["dtype"],
        kv_cache_dtype=config["vllm"]["kv_cache_dtype"],
    log:
        f"{RESULTS}/logs/engine_start_check.log",
    priority: 100
    resources:
        gpu=1,  # vLLM's platform (CUDA: the device's compute capability) decides its backends
    conda:
        ENV
    script:
        "../scripts/engine_start_check.py"
