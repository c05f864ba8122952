"""Time per stage for the plan: rates measured by an earlier run in the same results folder (its
Snakemake benchmark files beside what each stage produced), else the rates the config gives.

Every time is an estimate: it assumes this run goes as fast per token as the one measured.
"""

import csv
import json
import math
from pathlib import Path


def read_benchmark(path):
    """The wall time `s` (seconds) and peak RSS `max_rss_mib` of a Snakemake benchmark file, or
    None if it is absent or empty (a stage that did not run here, e.g. generation when the
    responses came from elsewhere). A cell Snakemake could not measure ("-", "NA") is None."""
    path = Path(path)
    if not path.is_file():
        return None
    with open(path) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows:
        return None
    row = rows[-1]  # one line per run; `--benchmark-repeats` would add more: the last one
    return {"s": _number(row.get("s")), "max_rss_mib": _number(row.get("max_rss"))}


def _number(cell):
    try:
        value = float(cell)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def benchmark_span(files):
    """Wall seconds that the jobs of benchmark `files` spanned, first start to last end: a
    benchmark file is written when its job ends, and holds its seconds (`s`). Jobs that ran at
    once (generate_part on one engine) count once. None when there are none."""
    ends, starts = [], []
    for path in files:
        seconds = read_benchmark(path)["s"]
        end = Path(path).stat().st_mtime
        ends.append(end)
        starts.append(end - seconds)
    return max(ends) - min(starts) if ends else None


def measured_generation(benchmarks, generated_tokens):
    """This run's generation (it ran before the plan): its generated tokens and wall seconds, or
    None when the responses came from elsewhere (config data.raw_responses)."""
    seconds = benchmark_span(sorted(Path(benchmarks, "generate").glob("part_*.tsv")))
    if seconds is None:
        return None
    return {"seconds": seconds, "rate": generated_tokens / seconds, "source": "this run's benchmark files"}


def earlier_extraction_rate(results, benchmarks):
    """Tokens per second of the earlier run's extraction: its manifest's tokens over the wall
    time its shard jobs spanned. None without both."""
    manifest = Path(results, "hidden_states", "manifest.json")
    files = sorted(Path(benchmarks, "hidden_states").glob("shard_*.tsv"))
    if not manifest.exists() or not files:
        return None
    tokens = sum(shard["num_tokens"] for shard in json.loads(manifest.read_text())["shards"])
    return tokens / benchmark_span(files)


def earlier_training_rate(results):
    """Supervised tokens per second of the earlier run's training (its train_log.tsv's last row:
    tokens trained, seconds of training). None without one."""
    path = Path(results, "train", "train_log.tsv")
    if not path.exists():
        return None
    with open(path) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows or float(rows[-1]["elapsed_s"]) <= 0:
        return None
    return float(rows[-1]["tokens"]) / float(rows[-1]["elapsed_s"])


def stage_estimate(stage, work, unit, measured_rate, configured_rate):
    """One row of the plan's stage table: `work` units at the earlier run's rate, else at the
    configured one (config plan.rates), else unknown."""
    if measured_rate:
        rate, source = measured_rate, "earlier run in this results folder"
    elif configured_rate:
        rate, source = configured_rate, "config plan.rates"
    else:
        rate, source = None, None
    return {"stage": stage, "work": work, "unit": unit, "rate": rate, "rate_source": source,
            "estimate_s": work / rate if rate else None}


def stage_times(*, results, benchmarks, generated_tokens, tokens, supervised_per_epoch, epochs, rates):
    """The plan's stage table: generation as this run measured it, extraction and training as
    estimates (tokens; supervised tokens over all epochs)."""
    stages = []
    generation = measured_generation(benchmarks, generated_tokens)
    if generation:
        stages.append({"stage": "generate", "work": generated_tokens, "unit": "generated tokens",
                       "rate": generation["rate"], "rate_source": generation["source"],
                       "estimate_s": generation["seconds"], "measured": True})
    stages.append(stage_estimate("hidden_states", tokens, "tokens", earlier_extraction_rate(results, benchmarks),
                                 rates.get("hidden_states")))
    stages.append(stage_estimate("train_drafter", supervised_per_epoch * epochs, "supervised tokens",
                                 earlier_training_rate(results), rates.get("train_drafter")))
    return stages
