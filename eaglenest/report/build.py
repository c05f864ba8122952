"""Every figure and table of the report in one stage (rule report_figures): each takes a second
at most, so one job makes them all."""

import logging
from pathlib import Path

from eaglenest.report.data import plot_coverage, plot_sample_lengths, write_coverage_table, write_prompt_sources_table
from eaglenest.report.evaluate import plot_acceptance, plot_speed, write_acceptance_table
from eaglenest.report.plan import write_plan_table
from eaglenest.report.states import plot_shards
from eaglenest.report.stages import write_stages_table
from eaglenest.report.train import plot_training

log = logging.getLogger(__name__)


def write_report_figures(inputs, outputs, benchmark_dir, *, draft_vocab_size, max_seq_len, overlong,
                         generated_here, target_source):
    """inputs and outputs: mappings by name (the rule's named input and output). inputs: {plan, tokenize, token_freq, coverage, manifest, train_log, check, offline,
    vllm, agreement} artifact paths; outputs: {plan, sample_lengths, coverage_plot, coverage_table,
    shards, training, acceptance, speed, acceptance_table, stages}, and prompt_sources in both
    when data.sources gave the prompts (read_prompts' counts, its table) file paths; benchmark_dir: the
    Snakemake benchmark files (results/benchmarks). Settings as in the config (tokenize.*,
    vocab.draft_vocab_size); generated_here / target_source: see stages.stages_table."""
    write_plan_table(inputs["plan"], outputs["plan"])
    plot_sample_lengths(inputs["plan"], inputs["tokenize"], outputs["sample_lengths"],
                        max_seq_len=max_seq_len, overlong=overlong)
    plot_coverage(inputs["token_freq"], outputs["coverage_plot"], draft_vocab_size=draft_vocab_size)
    write_coverage_table(inputs["token_freq"], outputs["coverage_table"], draft_vocab_size=draft_vocab_size)
    plot_shards(inputs["manifest"], f"{benchmark_dir}/hidden_states", outputs["shards"])
    plot_training(inputs["train_log"], outputs["training"])
    plot_acceptance(inputs["offline"], inputs["vllm"], outputs["acceptance"])
    plot_speed(inputs["offline"], inputs["vllm"], outputs["speed"])
    write_acceptance_table(inputs["offline"], inputs["vllm"], outputs["acceptance_table"])
    write_stages_table(inputs, benchmark_dir, outputs["stages"], generated_here=generated_here,
                       target_source=target_source)
    if "prompt_sources" in inputs:  # the prompts were read from data.sources
        write_prompt_sources_table(inputs["prompt_sources"], outputs["prompt_sources"])
    log.info("report figures and tables written beside %s", Path(outputs["plan"]).parent)
