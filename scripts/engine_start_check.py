from eaglenest.plan.engine_start import check_engine_start
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    check_engine_start,
    snakemake.input.target,
    snakemake.output.check,
    dtype=snakemake.params.dtype,
    kv_cache_dtype=snakemake.params.kv_cache_dtype,
    # read when it runs, rebuilding nothing when changed (rules/engine_start.smk)
    attention_backend=snakemake.config["vllm"]["attention_backend"],
    drafter_layer=snakemake.config["drafter"].get("layer"),
    drafter_head_dim=snakemake.config["drafter"]["head_dim"],
    gpus=snakemake.resources.gpu,
)
