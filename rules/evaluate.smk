# Pre-flight check of the drafter, offline evaluation on the held-out split, the drafter in real
# vLLM (vllm_runs), checked against the offline evaluator on the target's states of vLLM's text
# (agreement_states, evaluate_vllm), and the summary.


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
    benchmark:
        f"{BENCHMARKS}/evaluate_offline.tsv"
    log:
        f"{RESULTS}/logs/evaluate_offline.log",
    threads: lambda wildcards: workflow.cores
    resources:
        gpu=0 if config["train"]["device"] == "cpu" else 1,  # leased like the others, not cuda:0 by default
    conda:
        ENV
    script:
        "../scripts/evaluate_offline.py"


rule vllm_runs:
    input:
        tokenized=TOKENIZED,
        target=TARGET,
        drafter=DRAFTER,
        check=rules.check_drafter.output.check,  # the pre-flight check passed
    output:
        outputs=f"{RESULTS}/eval/vllm_greedy_outputs.jsonl",
        runs=f"{RESULTS}/eval/vllm_runs.json",
    params:
        heldout_fraction=config["train"]["heldout_fraction"],
        num_speculative_tokens=config["eval"]["num_speculative_tokens"],
        max_tokens=config["eval"]["max_tokens"],
        max_prompts=config["eval"]["max_prompts"],
        concurrency=config["eval"]["concurrency"],
        max_divergent_share=config["eval"]["max_divergent_share"],
        vllm=artifact_settings(config, "vllm"),  # speed and placement: read from the config (README "Rebuilding")
        trust_remote_code=config["target"]["trust_remote_code"],
        end_of_turn=config["tokenize"]["end_of_turn"],
        code=code("vllm_runs"),
    benchmark:
        f"{BENCHMARKS}/vllm_runs.tsv"
    log:
        f"{RESULTS}/logs/vllm_runs.log",
    threads: lambda wildcards: workflow.cores
    resources:
        gpu=config["vllm"]["tensor_parallel_size"],  # the target's tensor-parallel ranks; the drafter rides on them
    conda:
        ENV
    script:
        "../scripts/vllm_runs.py"


# The target's states of vLLM's greedy text for the agreement check, by the hidden_states stage's
# backend and settings (never a second copy of the target): eaglenest/evaluate/agreement_states.py.
rule agreement_states:
    input:
        outputs=rules.vllm_runs.output.outputs,
        manifest=MANIFEST,  # the trained aux layers
        target=TARGET,
    output:
        states=directory(f"{RESULTS}/eval/agreement_states"),
    params:
        backend=config["hidden_states"]["backend"],
        dtype=config["hidden_states"]["dtype"],
        # as rule hidden_states: only the vLLM backend reads these; devices and speed from the config
        vllm=artifact_settings(config, "vllm") if config["hidden_states"]["backend"] == "vllm" else None,
        trust_remote_code=config["target"]["trust_remote_code"],
        code=code("agreement_states"),
    benchmark:
        f"{BENCHMARKS}/agreement_states.tsv"
    log:
        f"{RESULTS}/logs/agreement_states.log",
    threads: lambda wildcards: workflow.cores
    resources:
        gpu=EXTRACTION_GPUS,  # as rule hidden_states
    conda:
        ENV
    script:
        "../scripts/agreement_states.py"


rule evaluate_vllm:
    input:
        runs=rules.vllm_runs.output.runs,
        outputs=rules.vllm_runs.output.outputs,
        states=rules.agreement_states.output.states,
        target=TARGET,  # its embedding only
        drafter=DRAFTER,
        trained_config=rules.train_drafter.output.trained_config,
        manifest=MANIFEST,
        d2t=rules.vocab_map.output.d2t,
        t2d=rules.vocab_map.output.t2d,
    output:
        metrics=f"{RESULTS}/eval/vllm_metrics.json",
    params:
        agreement_tolerance=config["eval"]["agreement_tolerance"],
        code=code("evaluate_vllm"),
    benchmark:
        f"{BENCHMARKS}/evaluate_vllm.tsv"
    log:
        f"{RESULTS}/logs/evaluate_vllm.log",
    threads: lambda wildcards: workflow.cores
    resources:
        gpu=0 if config["train"]["device"] == "cpu" else 1,  # the drafter alone, where it trained
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
