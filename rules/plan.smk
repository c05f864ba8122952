# The plan: what extraction and training will cost (disk, host RAM, GPU memory, time), from the
# exact token counts, before either starts. `snakemake plan` makes it alone. No stage takes it as
# an input: a plain edge would re-extract every shard whenever the plan changes (a free-disk
# reading, a speed setting), and ancient() makes Snakemake 9.27 skip missing shards in the run
# that remakes the plan (docs/SNAKEMAKE.md, "ancient() drops jobs"). It is ready when tokenization is, like shard_samples,
# and goes first by priority; the disk guard of every hidden_states job does its own arithmetic.

PLAN_SETTINGS = {
    "hidden_states": ["backend", "aux_layer_ids", "dtype", "device", "num_shards", "free_disk_margin_gb"],
    "train": ["heldout_fraction", "epochs", "max_tokens_per_batch", "ttt_steps", "init_from", "device",
              "num_processes", "activation_checkpointing", "bf16", "optimizer", "train_lm_head", "tv_weight"],
}


rule plan:
    input:
        tokenized=TOKENIZED,
        report=rules.tokenize.output.report,
        target=TARGET,
    output:
        plan=PLAN_JSON,
        markdown=f"{RESULTS}/plan.md",
    params:
        # all it computes with, speed and placement included (they are what it is about), no more
        hidden_states={key: config["hidden_states"][key] for key in PLAN_SETTINGS["hidden_states"]},
        train={key: config["train"][key] for key in PLAN_SETTINGS["train"]},
        drafter=config["drafter"],
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        rates=config["plan"]["rates"],
        code=code("plan"),
    log:
        f"{RESULTS}/logs/plan.log",
    priority: 100
    conda:
        ENV
    script:
        "../scripts/plan.py"
