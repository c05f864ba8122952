# The plan: what extraction and training will cost (disk, host RAM, GPU memory, time), from the
# exact token counts, before either starts. `snakemake plan` makes it alone; extraction reads it
# to refuse a disk that cannot take the shards (eaglenest/states/disk.py).


rule plan:
    input:
        tokenized=TOKENIZED,
        report=rules.tokenize.output.report,
        target=TARGET,
    output:
        plan=PLAN_JSON,
        markdown=f"{RESULTS}/plan.md",
    params:
        # all it computes with, speed settings included: they are what the plan is about
        hidden_states=config["hidden_states"],
        train=config["train"],
        drafter=config["drafter"],
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        rates=config["plan"]["rates"],
        code=code("plan"),
    log:
        f"{RESULTS}/logs/plan.log",
    conda:
        ENV
    script:
        "../scripts/plan.py"
