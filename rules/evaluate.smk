# Pre-flight check of the drafter, offline evaluation on the held-out split, the drafter in real
# vLLM (checked against the offline evaluator), and the summary.


rule check_drafter:
    input:
        drafter=DRAFTER,
        trained_config=rules.train_drafter.output.trained_config,
        manifest=MANIFEST,
        d2t=rules.vocab_map.output.d2t,
        t2d=rules.vocab_map.output.t2d,
        target=TARGET,
    output:
        check=f"{RESULTS}/eval/drafter_check.json",
    params:
        code=code("check_drafter"),
    log:
        f"{RESULTS}/logs/check_drafter.log",
    conda:
        ENV
    script:
        "../scripts/check_drafter.py"


rule evaluate_offline:
    input:
        shards=SHARDS,
        manifest=MANIFEST,
        drafter=DRAFTER,
        target=TARGET,
    output:
        metrics=f"{RESULTS}/eval/offline_metrics.json",
    params:
        heldout_fraction=config["train"]["heldout_fraction"],
        num_speculative_tokens=config["eval"]["num_speculative_tokens"],
        code=code("evaluate_offline"),
    log:
        f"{RESULTS}/logs/evaluate_offline.log",
    threads: lambda wildcards: workflow.cores
    resources:
        gpu=0 if config["train"]["device"] == "cpu" else 1,  # leased like the others, not cuda:0 by default
    conda:
        ENV
    script:
        "../scripts/evaluate_offline.py"


rule evaluate_vllm:
    input:
        tokenized=TOKENIZED,
        target=TARGET,
        drafter=DRAFTER,
        trained_config=rules.train_drafter.output.trained_config,
        manifest=MANIFEST,
        d2t=rules.vocab_map.output.d2t,
        t2d=rules.vocab_map.output.t2d,
        check=rules.check_drafter.output.check,  # the pre-flight check passed
    output:
        metrics=f"{RESULTS}/eval/vllm_metrics.json",
        outputs=f"{RESULTS}/eval/vllm_greedy_outputs.jsonl",
    params:
        heldout_fraction=config["train"]["heldout_fraction"],
        num_speculative_tokens=config["eval"]["num_speculative_tokens"],
        max_tokens=config["eval"]["max_tokens"],
        max_prompts=config["eval"]["max_prompts"],
        concurrency=config["eval"]["concurrency"],
        agreement_tolerance=config["eval"]["agreement_tolerance"],
        max_divergent_share=config["eval"]["max_divergent_share"],
        vllm=artifact_settings(config, "vllm"),  # speed and placement: read from the config (README "Rebuilding")
        trust_remote_code=config["target"]["trust_remote_code"],
        end_of_turn=config["tokenize"]["end_of_turn"],
        code=code("evaluate_vllm"),
    log:
        f"{RESULTS}/logs/evaluate_vllm.log",
    threads: lambda wildcards: workflow.cores
    resources:
        gpu=config["vllm"]["tensor_parallel_size"],  # the target's tensor-parallel ranks; the drafter rides on them
    conda:
        ENV
    script:
        "../scripts/evaluate_vllm.py"


rule summary:
    input:
        tokenize=rules.tokenize.output.report,
        coverage=rules.vocab_map.output.coverage,
        train_log=rules.train_drafter.output.train_log,
        offline=rules.evaluate_offline.output.metrics,
        online=rules.evaluate_vllm.output.metrics,
        check=rules.check_drafter.output.check,
    output:
        summary=f"{RESULTS}/summary.md",
    params:
        code=code("summary"),
    log:
        f"{RESULTS}/logs/summary.log",
    conda:
        ENV
    script:
        "../scripts/summary.py"
