from eaglenest.data.generate import merge_responses
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    merge_responses,
    snakemake.input.prompts,
    snakemake.input.parts,
    snakemake.output.raw,
    temperatures=snakemake.params.temperatures,
    samples_per_prompt=snakemake.params.samples_per_prompt,
)
