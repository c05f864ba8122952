from eaglenest.evaluate.online import vllm_runs
from eaglenest.workflow.stage import run_stage

if __name__ == "__main__":  # vLLM starts worker processes that import this file again
    run_stage(
        snakemake.log[0],
        snakemake.threads,
        vllm_runs,
        snakemake.input.tokenized,
        snakemake.input.target,
        snakemake.input.drafter,
        snakemake.output.outputs,
        snakemake.output.runs,
        heldout_fraction=snakemake.params.heldout_fraction,
        num_speculative_tokens=snakemake.params.num_speculative_tokens,
        max_tokens=snakemake.params.max_tokens,
        max_prompts=snakemake.params.max_prompts,
        concurrency=snakemake.params.concurrency,
        max_divergent_share=snakemake.params.max_divergent_share,
        vllm=snakemake.config["vllm"],
        trust_remote_code=snakemake.params.trust_remote_code,
        end_of_turn=snakemake.params.end_of_turn,
        gpus=snakemake.resources.gpu,
    )
