from eaglenest.demo.target import build_demo_target
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    build_demo_target,
    snakemake.input.corpus,
    snakemake.output.target,
    **snakemake.params.settings,
)
