# The report's figures (matplotlib, SVG) and tables (pandas, HTML) under results/report/, from
# every stage's artifacts and the GPU stages' benchmark files; `snakemake --report
# results/report.html` (make report) gathers them, with their captions (report/*.rst), into one
# self-contained page. The benchmark files are a param, not inputs: no rule makes them, and
# before a first run they do not exist. The inputs order the job after the stages that write them.

# Captions: report/*.rst (at the repository root). One label, "figure", names each item in the
# report's menus: Snakemake turns a second label with two values, each on half of a
# subcategory's items, into a toggle (whose missing combinations break the page).
REPORT = f"{RESULTS}/report"


rule report_figures:
    input:
        plan=PLAN_JSON,
        tokenize=rules.tokenize.output.report,
        token_freq=rules.token_freq.output.freq,
        coverage=rules.vocab_map.output.coverage,
        manifest=MANIFEST,
        train_log=rules.train_drafter.output.train_log,
        check=rules.check_drafter.output.check,
        offline=rules.evaluate_offline.output.metrics,
        vllm=rules.evaluate_vllm.output.metrics,
        agreement=rules.agreement_states.output.states,
        **({"prompt_sources": PROMPT_COUNTS} if SOURCES else {}),  # read_prompts' counts, with data.sources
    output:
        plan=report(
            f"{REPORT}/plan.html",
            caption="../report/plan.rst",
            category="Plan",
            labels={"figure": "The plan: sizes, memory, time per stage (table)"},
        ),
        sample_lengths=report(
            f"{REPORT}/sample_lengths.svg",
            caption="../report/sample_lengths.rst",
            category="Data",
            subcategory="Samples",
            labels={"figure": "Sample lengths, with truncation"},
        ),
        coverage_plot=report(
            f"{REPORT}/vocab_coverage.svg",
            caption="../report/vocab_coverage.rst",
            category="Data",
            subcategory="Draft vocabulary",
            labels={"figure": "Coverage against draft vocab size"},
        ),
        coverage_table=report(
            f"{REPORT}/vocab_coverage.html",
            caption="../report/vocab_coverage_table.rst",
            category="Data",
            subcategory="Draft vocabulary",
            labels={"figure": "Coverage of 8K, 16K, 32K, 64K ids (table)"},
        ),
        shards=report(
            f"{REPORT}/shards.svg",
            caption="../report/shards.rst",
            category="Hidden states",
            labels={"figure": "Tokens and extraction rate per shard"},
        ),
        training=report(
            f"{REPORT}/training.svg",
            caption="../report/training.rst",
            category="Training",
            labels={"figure": "Loss and accuracy per TTT step"},
        ),
        acceptance=report(
            f"{REPORT}/acceptance.svg",
            caption="../report/acceptance.rst",
            category="Evaluation",
            subcategory="Acceptance",
            labels={"figure": "Acceptance per position, offline and vLLM"},
        ),
        acceptance_table=report(
            f"{REPORT}/acceptance.html",
            caption="../report/acceptance_table.rst",
            category="Evaluation",
            subcategory="Acceptance",
            labels={"figure": "Every run, and the K to serve with (table)"},
        ),
        speed=report(
            f"{REPORT}/speed.svg",
            caption="../report/speed.rst",
            category="Evaluation",
            subcategory="Speed",
            labels={"figure": "Speed-up against K, per concurrency"},
        ),
        stages=report(
            f"{REPORT}/stages.html",
            caption="../report/stages.rst",
            category="Stages",
            labels={"figure": "What each stage did (table)"},
        ),
        **({"prompt_sources": report(
            f"{REPORT}/prompt_sources.html",
            caption="../report/prompt_sources.rst",
            category="Data",
            subcategory="Prompts",
            labels={"figure": "Prompts from each source (table)"},
        )} if SOURCES else {}),
    params:
        benchmarks=BENCHMARKS,
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        max_seq_len=config["tokenize"]["max_seq_len"],
        overlong=config["tokenize"]["overlong"],
        generated_here=not config["data"]["raw_responses"],
        target_source="demo" if config["target"]["demo"] else "gguf" if config["target"]["gguf"] else "path",
        code=code("report_figures"),
    log:
        f"{RESULTS}/logs/report_figures.log",
    conda:
        ENV
    script:
        "../scripts/report_figures.py"
