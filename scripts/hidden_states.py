from eaglenest.hidden_states import extract_shard_file
from eaglenest.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    extract_shard_file,
    snakemake.input.data,
    snakemake.input.target,
    snakemake.output.shard,
    shard=snakemake.params.shard,
    num_shards=snakemake.params.num_shards,
    aux_layer_ids=snakemake.params.aux_layer_ids,
    dtype=snakemake.params.dtype,
    device=snakemake.params.device,
)
