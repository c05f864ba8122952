from eaglenest.plan.plan import write_plan
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    write_plan,
    snakemake.input.tokenized,
    snakemake.input.report,
    snakemake.input.target,
    snakemake.output.plan,
    snakemake.output.markdown,
    results=snakemake.config["results"],
    benchmarks=f"{snakemake.config['results']}/benchmarks",
    hidden_states=snakemake.params.hidden_states,
    train=snakemake.params.train,
    drafter=snakemake.params.drafter,
    draft_vocab_size=snakemake.params.draft_vocab_size,
    rates=snakemake.params.rates,
)
