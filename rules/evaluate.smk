# Pre-flight check of the drafter, offline evaluation on the held-out split, the drafter in real
# vLLM on every suite, temperature, draft method, K and concurrency (eval_prompts, vllm_baseline, vllm_speculative),
# checked against the offline evaluator on the target's states of the baseline's text
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
        num_speculative_tokens=max(SPECULATIVE_TOKENS),  # a draft's depths do not depend on K: the deepest
        trust_remote_code=config["target"]["trust_remote_code"],
        tool_call_tokens=config["tokenize"].get("tool_call_tokens"),  # acceptance on tool-call spans
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


rule eval_prompts:
    input:
        unpack(suite_source),
    output:
        prompts=f"{RESULTS}/eval/prompts/{{suite}}.jsonl",
    params:
        heldout_fraction=lambda wildcards: config["train"]["heldout_fraction"] if wildcards.suite == HELDOUT else None,
        max_prompts=config["eval"]["max_prompts"],
        # a suite file is rendered as tokenize renders prompts
        tokenize=lambda wildcards: None if wildcards.suite == HELDOUT else {
            "trust_remote_code": config["target"]["trust_remote_code"],
            **{key: config["tokenize"][key] for key in ("chat_template_kwargs", "think_start", "think_end", "end_of_turn")},
        },
        code=code("eval_prompts"),
    log:
        f"{RESULTS}/logs/eval_prompts/{{suite}}.log",
    wildcard_constraints:
        suite=SUITE_PATTERN,
    conda:
        ENV
    script:
        "../scripts/eval_prompts.py"


# What every vLLM run shares (vllm_baseline, vllm_speculative): the grid (but its temperatures: a
# draft method runs its own, eaglenest.workflow.config.method_temperatures) and the engine settings
VLLM_RUN_PARAMS = {
    "suites": SUITES,
    "concurrency": config["eval"]["concurrency"],
    "latency_prompts": config["eval"]["latency_prompts"],
    "max_tokens": config["eval"]["max_tokens"],
    "seed": config["eval"]["seed"],
    "vllm": artifact_settings(config, "vllm"),  # speed and placement: read from the config (docs/REBUILDING.md)
    "trust_remote_code": config["target"]["trust_remote_code"],
    "end_of_turn": config["tokenize"]["end_of_turn"],
}


rule vllm_baseline:
    input:
        prompts=SUITE_PROMPTS,
        target=TARGET,
        engine_start=rules.engine_start_check.output.check,  # the drafter engines can start (their stages come after it)
    output:
        runs=f"{RESULTS}/eval/vllm_baseline.json",
        outputs=f"{RESULTS}/eval/vllm_baseline_outputs.jsonl",
    params:
        **VLLM_RUN_PARAMS,
        temperatures=config["eval"]["temperatures"],
        code=code("vllm_baseline"),
    benchmark:
        f"{BENCHMARKS}/vllm_baseline.tsv"
    log:
        f"{RESULTS}/logs/vllm_baseline.log",
    threads: lambda wildcards: workflow.cores
    resources:
        gpu=config["vllm"]["tensor_parallel_size"],  # the target's tensor-parallel ranks
    conda:
        ENV
    script:
        "../scripts/vllm_baseline.py"


rule vllm_speculative:
    input:
        prompts=SUITE_PROMPTS,
        target=TARGET,
        drafter=DRAFTER,
        baseline=rules.vllm_baseline.output.outputs,  # speculation must not change its greedy text
        check=rules.check_drafter.output.check,  # the pre-flight check passed
    output:
        runs=f"{RESULTS}/eval/vllm_speculative/{{method}}/K{{k}}.json",
    params:
        **VLLM_RUN_PARAMS,
        temperatures=lambda wildcards: method_temperatures(wildcards.method, config["eval"]["temperatures"]),
        num_speculative_tokens=lambda wildcards: int(wildcards.k),
        draft_sample_method=lambda wildcards: wildcards.method,
        tool_call_tokens=config["tokenize"].get("tool_call_tokens"),  # vLLM's counters split on tool-call spans
        code=code("vllm_speculative"),
    benchmark:
        f"{BENCHMARKS}/vllm_speculative/{{method}}/K{{k}}.tsv"
    log:
        f"{RESULTS}/logs/vllm_speculative/{{method}}/K{{k}}.log",
    wildcard_constraints:
        method="|".join(sorted({method for method, _ in DRAFTER_ENGINES})),
        k=r"\d+",
    threads: lambda wildcards: workflow.cores
    resources:
        gpu=config["vllm"]["tensor_parallel_size"],  # the target's tensor-parallel ranks; the drafter rides on them
    conda:
        ENV
    script:
        "../scripts/vllm_speculative.py"


# The target's states of the baseline's reference texts for the agreement check, by the hidden_states
# stage's backend and settings (never a second copy of the target): eaglenest/evaluate/agreement_states.py.
rule agreement_states:
    input:
        outputs=rules.vllm_baseline.output.outputs,
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
        baseline=rules.vllm_baseline.output.runs,
        outputs=rules.vllm_baseline.output.outputs,
        speculative=SPECULATIVE_RUNS,
        states=rules.agreement_states.output.states,
        target=TARGET,  # its embedding only (and final norm and lm_head above temperature 0)
        drafter=DRAFTER,
        trained_config=rules.train_drafter.output.trained_config,
        manifest=MANIFEST,
        d2t=rules.vocab_map.output.d2t,
        t2d=rules.vocab_map.output.t2d,
    output:
        metrics=f"{RESULTS}/eval/vllm_metrics.json",
    params:
        agreement_tolerance=config["eval"]["agreement_tolerance"],
        agreement_standard_errors=config["eval"]["agreement_standard_errors"],
        trust_remote_code=config["target"]["trust_remote_code"],
        tool_call_tokens=config["tokenize"].get("tool_call_tokens"),  # acceptance on tool-call spans
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
        **({"prompt_sources": PROMPT_COUNTS} if SOURCES else {}),  # what read_prompts took of each source
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
