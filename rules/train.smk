# The EAGLE-3 drafter, trained with training-time test on the extracted hidden states, and its
# export in the EAGLE/SGLang format (results/drafter is the speculators format).


rule train_drafter:
    input:
        shards=SHARDS,
        manifest=MANIFEST,
        d2t=rules.vocab_map.output.d2t,
        t2d=rules.vocab_map.output.t2d,
        target=TARGET,
    output:
        drafter=directory(DRAFTER),
        train_log=f"{RESULTS}/train/train_log.tsv",
    params:
        settings=config["train"],
        code=code("train_drafter"),
    log:
        f"{RESULTS}/logs/train_drafter.log",
    threads: workflow.cores
    conda:
        ENV
    script:
        "../scripts/train_drafter.py"


rule export_eagle:
    input:
        drafter=DRAFTER,
    output:
        drafter=directory(f"{RESULTS}/drafter_eagle"),
    params:
        code=code("export_eagle"),
    log:
        f"{RESULTS}/logs/export_eagle.log",
    conda:
        ENV
    script:
        "../scripts/export_eagle.py"
