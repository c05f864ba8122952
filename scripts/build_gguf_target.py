from eaglenest.data.gguf_target import build_gguf_target
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    build_gguf_target,
    snakemake.input.gguf,
    snakemake.output.target,
    package=snakemake.params.package,
    sha256=snakemake.params.sha256,
)
