from eaglenest.evaluate.suites import write_suite_prompts
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    write_suite_prompts,
    snakemake.output.prompts,
    snakemake.wildcards.suite,
    tokenized_path=snakemake.input.get("tokenized"),
    prompts_path=snakemake.input.get("prompts"),
    target_dir=snakemake.input.get("target"),
    heldout_fraction=snakemake.params.heldout_fraction,
    max_prompts=snakemake.params.max_prompts,
    tokenize=snakemake.params.tokenize,
)
