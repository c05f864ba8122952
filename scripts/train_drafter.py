from eaglenest.workflow.stage import run_stage
from eaglenest.train.loop import train_drafter

run_stage(
    snakemake.log[0],
    snakemake.threads,
    train_drafter,
    snakemake.input.shards,
    snakemake.input.manifest,
    snakemake.input.d2t,
    snakemake.input.t2d,
    snakemake.input.target,
    snakemake.output.drafter,
    snakemake.output.train_log,
    trained_config_path=snakemake.output.trained_config,
    resume_dir=snakemake.params.resume_dir,
    **snakemake.config["train"] | snakemake.params.settings,  # speed settings, then the rule's: temperature resolved
    drafter_geometry=snakemake.params.drafter,
    nnodes=snakemake.resources.get("nodes", 1),  # multi-node (SLURM profile): the job's nodes and the
    launcher=snakemake.resources.get("mpi", ""),  # command that starts torchrun on each of them
    gpus=snakemake.resources.gpu,
    tracking=snakemake.config.get("tracking", {}),  # observability only: not a param (docs/REBUILDING.md)
)
