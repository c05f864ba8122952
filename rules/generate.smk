# The target answers the prompts in vLLM: the responses the drafter learns from (skipped when
# config data.raw_responses names a file of responses generated elsewhere). In parts: prompts go
# to generate.num_parts parts by a hash of their id (the split_prompts checkpoint, as
# shard_samples does for hidden states: eaglenest/workflow/parts.py says how), one generate_part
# job answers each, and generate_responses merges them in the order of the prompts file. A kill
# loses only the parts being answered; appending prompts regenerates only the parts that gain them.
# Each prompt is answered at generate.temperatures, its answers in its part. Null means
# eval.temperatures, resolved here into the params: a change of eval.temperatures then regenerates.

GENERATE_TEMPERATURES = generation_temperatures(config)

PROMPT_PARTS = f"{RESULTS}/responses/prompts"  # part_NNNNN.jsonl: a part's prompts, .sha256: their digest
RESPONSE_PART = f"{RESULTS}/responses/parts/part_{{part}}.jsonl"
RESPONSE_PARTS = expand(RESPONSE_PART, part=[f"{i:05d}" for i in range(config["generate"]["num_parts"])])


if SOURCES:

    # data.sources: datasets in their own shapes and containers, mixed and checked whole, written as
    # one prompts file in eaglenest's shape (eaglenest/data/sources.py; docs/DATA.md). With
    # data.prompts instead, that file is answered as it is and this rule is not part of the run.
    rule read_prompts:
        input:
            sources=[source["path"] for source in SOURCES],
        output:
            prompts=PROMPTS,
            counts=PROMPT_COUNTS,
        params:
            sources=SOURCES,
            mix_seed=config["data"].get("mix_seed", 0),
            code=code("read_prompts"),
        log:
            f"{RESULTS}/logs/read_prompts.log",
        conda:
            ENV
        script:
            "../scripts/read_prompts.py"


if not config["data"]["raw_responses"]:

    checkpoint split_prompts:
        input:
            prompts=PROMPTS,
        output:
            parts=directory(PROMPT_PARTS),
        params:
            num_parts=config["generate"]["num_parts"],
            code=code("split_prompts"),
        log:
            f"{RESULTS}/logs/split_prompts.log",
        conda:
            ENV
        script:
            "../scripts/split_prompts.py"

    rule generate_part:
        input:
            unpack(split_part("split_prompts", "part")),
            target=TARGET,
            engine_start=rules.engine_start_check.output.check,  # the drafter engines can start: before the hours of generation
        output:
            part=RESPONSE_PART,
        wildcard_constraints:
            part=r"\d{5}",
        params:
            trust_remote_code=config["target"]["trust_remote_code"],
            # what a record is made with; not num_parts: a record never depends on its part
            generate=({key: value for key, value in config["generate"].items() if key != "num_parts"}
                      | {"temperatures": GENERATE_TEMPERATURES}),
            vllm=artifact_settings(config, "vllm"),  # speed and placement: read from the config
            chat_template_kwargs=config["tokenize"]["chat_template_kwargs"],
            think_start=config["tokenize"]["think_start"],
            think_end=config["tokenize"]["think_end"],
            end_of_turn=config["tokenize"]["end_of_turn"],
            code=code("generate_part"),
        benchmark:
            f"{BENCHMARKS}/generate/part_{{part}}.tsv"
        log:
            f"{RESULTS}/logs/generate/part_{{part}}.log",
        threads: 1  # the job waits on the generate service, which does the work
        resources:
            # vLLM's tensor-parallel ranks, a GPU each: what a cluster job asks for (its service runs
            # inside it). The blackwell profile sets 0: on one machine the generate service leases
            # them itself, so the part jobs hold none, run at once and share its batch.
            gpu=config["vllm"]["tensor_parallel_size"],
        conda:
            ENV
        script:
            "../scripts/generate_part.py"

    rule generate_responses:
        input:
            prompts=PROMPTS,  # the order of the merged records
            parts=RESPONSE_PARTS,
        output:
            raw=RAW_RESPONSES,
        params:
            temperatures=GENERATE_TEMPERATURES,  # with samples_per_prompt: the answer ids each prompt has
            samples_per_prompt=config["generate"]["samples_per_prompt"],
            code=code("generate_responses"),
        log:
            f"{RESULTS}/logs/generate_responses.log",
        conda:
            ENV
        script:
            "../scripts/generate_responses.py"
