# The demo target: a tiny Kimi-style model and tokenizer built deterministically from a seed.

if config["target"]["demo"]:

    rule build_demo_target:
        input:
            corpus=config["demo_target"]["corpus"],
        output:
            target=directory(TARGET),
        params:
            settings={k: v for k, v in config["demo_target"].items() if k != "corpus"},
            code=code("build_demo_target"),
        log:
            f"{RESULTS}/logs/build_demo_target.log",
        threads: lambda wildcards: workflow.cores  # all cores; a callable, so that --unlock needs no --cores
        conda:
            ENV
        script:
            "../scripts/build_demo_target.py"
