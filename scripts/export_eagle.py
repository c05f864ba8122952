from eaglenest.drafter.export import export_eagle
from eaglenest.workflow.stage import run_stage

run_stage(snakemake.log[0], snakemake.threads, export_eagle, snakemake.input.drafter, snakemake.output.drafter)
