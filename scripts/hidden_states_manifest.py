from eaglenest.states.manifest import write_manifest
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    write_manifest,
    snakemake.input.shards,
    snakemake.input.target,
    snakemake.output.manifest,
    aux_layer_ids=snakemake.params.aux_layer_ids,
    dtype=snakemake.params.dtype,
)
