from eaglenest.data.generate import split_prompts
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    split_prompts,
    snakemake.input.prompts,
    snakemake.output.parts,
    snakemake.params.num_parts,
)
