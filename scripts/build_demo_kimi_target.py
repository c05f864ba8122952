from eaglenest.demo.kimi import build_demo_kimi_target
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    build_demo_kimi_target,
    snakemake.input.corpus,
    snakemake.output.target,
    **snakemake.params.settings,
)
