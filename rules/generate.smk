# The target answers the prompts in vLLM: the responses the drafter learns from (skipped when
# config data.raw_responses names a file of responses generated elsewhere).

if not config["data"]["raw_responses"]:

    rule generate_responses:
        input:
            prompts=config["data"]["prompts"],
            target=TARGET,
        output:
            raw=RAW_RESPONSES,
        params:
            trust_remote_code=config["target"]["trust_remote_code"],
            generate=config["generate"],
            vllm=artifact_settings(config, "vllm"),  # speed and placement: read from the config
            chat_template_kwargs=config["tokenize"]["chat_template_kwargs"],
            think_start=config["tokenize"]["think_start"],
            think_end=config["tokenize"]["think_end"],
            end_of_turn=config["tokenize"]["end_of_turn"],
            code=code("generate_responses"),
        log:
            f"{RESULTS}/logs/generate_responses.log",
        threads: lambda wildcards: workflow.cores
        resources:
            gpu=config["vllm"]["tensor_parallel_size"],  # vLLM's tensor-parallel ranks, a GPU each
        conda:
            ENV
        script:
            "../scripts/generate_responses.py"
