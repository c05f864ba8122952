from eaglenest.workflow.stage import run_stage
from eaglenest.data.tokenize import tokenize_file

run_stage(
    snakemake.log[0],
    snakemake.threads,
    tokenize_file,
    snakemake.input.raw,
    snakemake.input.target,
    snakemake.output.data,
    snakemake.output.report,
    trust_remote_code=snakemake.params.trust_remote_code,
    max_seq_len=snakemake.params.max_seq_len,
    overlong=snakemake.params.overlong,
    chat_template_kwargs=snakemake.params.chat_template_kwargs,
    think_start=snakemake.params.think_start,
    think_end=snakemake.params.think_end,
    end_of_turn=snakemake.params.end_of_turn,
    tool_call_tokens=snakemake.params.tool_call_tokens,
)
