from eaglenest.workflow.stage import run_stage
from eaglenest.data.vocab import vocab_map

run_stage(
    snakemake.log[0],
    snakemake.threads,
    vocab_map,
    snakemake.input.freq,
    snakemake.output.d2t,
    snakemake.output.t2d,
    snakemake.output.coverage,
    draft_vocab_size=snakemake.params.draft_vocab_size,
)
