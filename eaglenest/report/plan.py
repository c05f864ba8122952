"""The Plan tables: what the run needs (plan.json: sizes, disk and memory), how long each stage
should take, and what the training memory is made of, as pandas tables."""

import pandas as pd

from eaglenest.report.common import DASH, count, duration, read_json, size, write_tables

LABELS = {  # plan.json's scalars, in the order shown; any others follow under their own names
    "samples": "samples",
    "tokens": "tokens",
    "generated_tokens": "generated tokens",
    "truncated_samples": "truncated samples",
    "longest_sample": "longest sample (tokens)",
    "hidden_states_bytes": "hidden states on disk",
    "hidden_states_bytes_per_token": "hidden-state bytes per token",
    "hidden_states_dir": "hidden states go to",
    "free_disk_bytes": "free disk there",
    "free_disk_margin_bytes": "free disk kept spare",
    "extraction_host_ram_bytes": "host RAM per extraction job",
    "training_gpu_memory_bytes": "training memory per process (peak)",
}


def _value(key, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return DASH if value is None else str(value)
    if key.endswith("_bytes"):
        return size(value)
    return count(value) if float(value).is_integer() else f"{value:.3g}"


def plan_totals(plan):
    """DataFrame (quantity, value) of the plan's scalars: counts with separators, bytes in MB/GB;
    with where training runs (training_memory)."""
    keys = [k for k in LABELS if k in plan]
    keys += sorted(k for k, v in plan.items() if k not in LABELS and not isinstance(v, (list, dict)))
    rows = [(LABELS.get(k, k.replace("_", " ")), _value(k, plan[k])) for k in keys]
    memory = plan.get("training_memory")
    if memory:
        rows.append(("training runs on", f"{memory.get('device', DASH)}, {memory.get('processes', 1)} process(es), "
                     f"bf16 autocast {'on' if memory.get('bf16_autocast') else 'off'}, micro-batches of "
                     f"{count(memory.get('micro_batch_tokens'))} tokens"))
    return pd.DataFrame(rows, columns=["quantity", "value"])


def _rate(rate, unit):
    if rate is None:
        return DASH
    return f"{rate:,.0f} {unit}/s" if rate >= 100 else f"{rate:.3g} {unit}/s"


def plan_stages(plan):
    """DataFrame, one row per stage: its work, the rate and where it came from, the time (measured
    for a stage that ran before the plan, else an estimate); a last row with their sum."""
    rows = []
    for stage in plan.get("stages", []):
        unit, estimate = stage.get("unit") or "", stage.get("estimate_s")
        rows.append({
            "stage": stage["stage"],
            "work": f"{count(stage.get('work'))} {unit}".strip(),
            "rate": _rate(stage.get("rate"), unit),
            "rate from": stage.get("rate_source") or "no rate yet: an earlier run or config plan.rates gives one",
            "time": duration(estimate) if estimate is None else
            f"{duration(estimate)} ({'measured' if stage.get('measured') else 'estimate'})",
        })
    known = [s["estimate_s"] for s in plan.get("stages", []) if s.get("estimate_s") is not None]
    if rows:
        unknown = len(rows) - len(known)
        rows.append({"stage": "total", "work": "", "rate": "",
                     "rate from": f"{unknown} stage(s) without an estimate" if unknown else "",
                     "time": duration(sum(known)) if known else DASH})
    return pd.DataFrame(rows, columns=["stage", "work", "rate", "rate from", "time"])


def memory_terms(plan):
    """DataFrame (term, bytes) of the training memory model's terms, largest first (docs/MEMORY.md)."""
    terms = (plan.get("training_memory") or {}).get("terms", {})
    ordered = sorted(((k, v) for k, v in terms.items() if k != "peak"), key=lambda kv: -kv[1])
    rows = [(k.replace("_", " "), size(v)) for k, v in ordered if v]
    if "peak" in terms:
        rows.append(("peak (not the sum: terms live at different times)", size(terms["peak"])))
    return pd.DataFrame(rows, columns=["term", "memory"])


def write_plan_table(plan_path, table_path):
    """The plan as HTML: its sizes and memory, its stages, the training memory's terms."""
    plan = read_json(plan_path)
    note = ("What this run needs and how long each stage should take, worked out by rule plan before "
            "extraction and training start (results/plan.md says the same). A time is measured for a "
            "stage that ran before the plan, else an estimate at an earlier run's rate or config plan.rates.")
    tables = [("Sizes and memory", plan_totals(plan)), ("Time per stage", plan_stages(plan))]
    terms = memory_terms(plan)
    if len(terms):
        tables.append(("Training memory per process, by term", terms))
    write_tables(table_path, "The plan", tables, note, numeric={"value", "work", "rate", "time", "memory"})
