# The EAGLE-3 drafter, trained with training-time test on the extracted hidden states.


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
