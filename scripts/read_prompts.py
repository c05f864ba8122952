from eaglenest.data.sources import read_sources
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    read_sources,
    snakemake.params.sources,
    snakemake.output.prompts,
    snakemake.output.counts,
    mix_seed=snakemake.params.mix_seed,
)
