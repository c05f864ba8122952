from eaglenest.drafter.check import check_drafter
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    check_drafter,
    snakemake.input.drafter,
    snakemake.input.trained_config,
    snakemake.input.manifest,
    snakemake.input.d2t,
    snakemake.input.t2d,
    snakemake.input.target,
    snakemake.output.check,
)
