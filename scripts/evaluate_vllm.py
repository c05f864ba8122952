from eaglenest.evaluate.agreement import evaluate_vllm
from eaglenest.workflow.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    evaluate_vllm,
    snakemake.input.baseline,
    snakemake.input.outputs,
    snakemake.input.speculative,
    snakemake.input.states,
    snakemake.input.target,
    snakemake.input.drafter,
    snakemake.input.trained_config,
    snakemake.input.manifest,
    snakemake.input.d2t,
    snakemake.input.t2d,
    snakemake.output.metrics,
    agreement_tolerance=snakemake.params.agreement_tolerance,
    agreement_standard_errors=snakemake.params.agreement_standard_errors,
    trust_remote_code=snakemake.params.trust_remote_code,
    tool_call_tokens=snakemake.params.tool_call_tokens,
    device=snakemake.config["train"]["device"],  # the drafter runs where it trained
    gpus=snakemake.resources.gpu,
    tracking=snakemake.config.get("tracking", {}),  # observability only: not a param (docs/REBUILDING.md)
)
