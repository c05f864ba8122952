from eaglenest.data.generate import generate_part
from eaglenest.workflow.stage import run_stage

if __name__ == "__main__":  # vLLM starts worker processes that import this file again
    run_stage(
        snakemake.log[0],
        snakemake.threads,
        generate_part,
        snakemake.input.part,
        snakemake.input.target,
        snakemake.output.part,
        **snakemake.params.generate,
        part=snakemake.wildcards.part,
        num_parts=snakemake.config["generate"]["num_parts"],
        source=snakemake.config["data"]["prompts"],
        trust_remote_code=snakemake.params.trust_remote_code,
        chat_template_kwargs=snakemake.params.chat_template_kwargs,
        think_start=snakemake.params.think_start,
        think_end=snakemake.params.think_end,
        end_of_turn=snakemake.params.end_of_turn,
        vllm=snakemake.config["vllm"],
        engine_log=f"{snakemake.config['results']}/logs/generate/engine.log",
        engine_gpus=snakemake.config["vllm"]["tensor_parallel_size"],  # the service holds the GPUs, not the job
    )
