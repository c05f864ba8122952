from eaglenest.states.parts import split_tokenized
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    split_tokenized,
    snakemake.input.data,
    snakemake.output.parts,
    snakemake.params.num_shards,
)
