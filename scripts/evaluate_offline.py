from eaglenest.evaluate.offline import evaluate_offline
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    evaluate_offline,
    snakemake.input.shards,
    snakemake.input.manifest,
    snakemake.input.drafter,
    snakemake.input.target,
    snakemake.output.metrics,
    heldout_fraction=snakemake.params.heldout_fraction,
    num_speculative_tokens=snakemake.params.num_speculative_tokens,
    trust_remote_code=snakemake.params.trust_remote_code,
    tool_call_tokens=snakemake.params.tool_call_tokens,
    device=snakemake.config["train"]["device"],  # the drafter runs where it trained
    max_tokens_per_batch=snakemake.config["eval"]["max_tokens_per_batch"],  # speed only: not a param
    gpus=snakemake.resources.gpu,
    tracking=snakemake.config.get("tracking", {}),  # observability only: not a param (docs/REBUILDING.md)
)
