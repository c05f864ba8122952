from eaglenest.shard_files import split_tokenized
from eaglenest.stage import run_stage

run_stage(
    snakemake.log[0],
    snakemake.threads,
    split_tokenized,
    snakemake.input.data,
    snakemake.output.parts,
    snakemake.params.num_shards,
)
