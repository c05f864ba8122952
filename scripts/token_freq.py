from eaglenest.workflow.stage import run_stage
from eaglenest.data.vocab import token_freq

run_stage(
    snakemake.log[0],
    snakemake.threads,
    token_freq,
    snakemake.input.data,
    snakemake.input.target,
    snakemake.output.freq,
)
