from eaglenest.states.extract import extract_shard_part
from eaglenest.workflow.stage import run_stage

if __name__ == "__main__":  # the vLLM backend starts processes that may import this file again
    run_stage(
        snakemake.log[0],
        snakemake.threads,
        extract_shard_part,
        snakemake.input.part,
        snakemake.input.target,
        snakemake.output.shard,
        backend=snakemake.params.backend,
        aux_layer_ids=snakemake.params.aux_layer_ids,
        dtype=snakemake.params.dtype,
        device=snakemake.config["hidden_states"]["device"],
        batch_tokens=snakemake.config["hidden_states"]["batch_tokens"],
        vllm=snakemake.config["vllm"],
        trust_remote_code=snakemake.params.trust_remote_code,
        engine_log=f"{snakemake.config['results']}/logs/hidden_states/engine.log",
        free_disk_margin_gb=snakemake.config["hidden_states"]["free_disk_margin_gb"],
        gpus=snakemake.resources.gpu,
    )
