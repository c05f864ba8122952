from eaglenest.stage import run_stage
from eaglenest.train import train_drafter

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
    **snakemake.params.settings,
)
