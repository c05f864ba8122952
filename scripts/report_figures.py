from eaglenest.workflow.stage import run_stage
from eaglenest.report.build import write_report_figures

run_stage(
    snakemake.log[0],
    snakemake.threads,
    write_report_figures,
    snakemake.input,
    snakemake.output,
    snakemake.params.benchmarks,
    draft_vocab_size=snakemake.params.draft_vocab_size,
    max_seq_len=snakemake.params.max_seq_len,
    overlong=snakemake.params.overlong,
    generated_here=snakemake.params.generated_here,
    target_source=snakemake.params.target_source,
)
