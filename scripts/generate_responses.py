from eaglenest.data.generate import generate_responses
from eaglenest.workflow.stage import run_stage

if __name__ == "__main__":  # vLLM starts worker processes that import this file again
    run_stage(
        snakemake.log[0],
        snakemake.threads,
        generate_responses,
        snakemake.input.prompts,
        snakemake.input.target,
        snakemake.output.raw,
        trust_remote_code=snakemake.params.trust_remote_code,
        **snakemake.params.generate,
        chat_template_kwargs=snakemake.params.chat_template_kwargs,
        think_start=snakemake.params.think_start,
        think_end=snakemake.params.think_end,
        end_of_turn=snakemake.params.end_of_turn,
        vllm=snakemake.config["vllm"],
        gpus=snakemake.resources.gpu,
    )
