from eaglenest.workflow.stage import run_stage
from eaglenest.evaluate.summary import write_summary

run_stage(
    snakemake.log[0],
    snakemake.threads,
    write_summary,
    snakemake.input.tokenize,
    snakemake.input.coverage,
    snakemake.input.train_log,
    snakemake.input.offline,
    snakemake.input.online,
    snakemake.output.summary,
    prompt_sources=snakemake.input.get("prompt_sources"),
)
