# The EAGLE-3 drafter, trained with training-time test on the extracted hidden states, and its
# export in the EAGLE/SGLang format (results/drafter is the speculators format).


# Paths, not rules.vocab_map.output: Snakemake 9.27 hashes a rule's whole list input once per
# file when the rule also references another rule's output, a cost every dry run pays at 1,000
# shards (BENCHMARKS.md).
rule train_drafter:
    input:
        shards=SHARDS,
        manifest=MANIFEST,
        d2t=D2T,
        t2d=T2D,
        target=TARGET,
    output:
        drafter=directory(DRAFTER),
        train_log=f"{RESULTS}/train/train_log.tsv",
        trained_config=f"{RESULTS}/train/drafter_config.json",
    params:
        # device, processes, loader, bf16 ...: read from the config. train.temperature as the number it
        # resolves to: a change of eval.temperatures retrains only if it changes that.
        settings=artifact_settings(config, "train") | {"temperature": fitted_temperature(config)},
        drafter=config["drafter"],  # the geometry: a change makes the drafter stale
        # Not an output: Snakemake deletes a failed job's outputs, and a checkpoint must outlive a kill.
        resume_dir=f"{RESULTS}/train/resume",
        code=code("train_drafter"),
    benchmark:
        f"{BENCHMARKS}/train_drafter.tsv"
    log:
        f"{RESULTS}/logs/train_drafter.log",
    threads: lambda wildcards: workflow.cores
    resources:
        # a GPU per DDP process unless training on CPU: what the machine's `--resources gpu=N`,
        # the lease (eaglenest/workflow/gpu_lease.py) and a cluster count. Multi-node (SLURM): `nodes` and
        # `mpi` (the launcher that starts torchrun on each node) come from the profile.
        gpu=0 if config["train"]["device"] == "cpu" else config["train"]["num_processes"],
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
