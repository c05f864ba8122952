from eaglenest.hidden_states import extract_shard_part
from eaglenest.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    extract_shard_part,
    snakemake.input.part,
    snakemake.input.target,
    snakemake.output.shard,
    snakemake.output.sum,
    aux_layer_ids=snakemake.params.aux_layer_ids,
    dtype=snakemake.params.dtype,
    device=snakemake.params.device,
)
