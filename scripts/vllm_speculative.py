from eaglenest.evaluate.online import vllm_speculative
from eaglenest.workflow.stage import run_stage

if __name__ == "__main__":  # vLLM starts worker processes that import this file again
    run_stage(
        snakemake.log[0],
        snakemake.threads,
        vllm_speculative,
        snakemake.input.prompts,
        snakemake.input.target,
        snakemake.input.drafter,
        snakemake.input.baseline,
        snakemake.output.runs,
        num_speculative_tokens=snakemake.params.num_speculative_tokens,
        draft_sample_method=snakemake.params.draft_sample_method,
        suites=snakemake.params.suites,
        temperatures=snakemake.params.temperatures,
        concurrency=snakemake.params.concurrency,
        latency_prompts=snakemake.params.latency_prompts,
        max_tokens=snakemake.params.max_tokens,
        seed=snakemake.params.seed,
        vllm=snakemake.config["vllm"],
        trust_remote_code=snakemake.params.trust_remote_code,
        end_of_turn=snakemake.params.end_of_turn,
        tool_call_tokens=snakemake.params.tool_call_tokens,
        gpus=snakemake.resources.gpu,
    )
