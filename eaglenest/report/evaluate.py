"""The Evaluation figures: acceptance per position offline and in vLLM side by side, and what
the drafter buys (mean acceptance length, tokens/s with and without it), plus their table."""

import numpy as np
import pandas as pd

from eaglenest.report.common import SOURCES, bar_axes, count, label_bars, read_json, svg_figure, write_tables


def acceptance_sources(offline_path, vllm_path):
    """{source key: acceptance figures} (SOURCES' keys, in that order): vLLM's counters, the
    offline evaluator on vLLM's greedy text, and offline on the held-out shards at the anchors
    vLLM drafts from ("served", the comparable figure)."""
    online = read_json(vllm_path)
    offline = read_json(offline_path)
    return {"vllm": online, "offline_vllm_text": online["offline_on_vllm_text"], "offline_heldout": offline["served"]}


def plot_acceptance(offline_path, vllm_path, svg_path):
    """Grouped bars: at each draft position k, the share of drafts accepted through k, one bar per
    source; offline and vLLM agree when the bars of a group are level."""
    sources = acceptance_sources(offline_path, vllm_path)
    K = len(sources["vllm"]["acceptance_rate_per_position"])
    x = np.arange(1, K + 1)
    width = 0.8 / len(sources)
    online = read_json(vllm_path)
    title = (f"Acceptance per position, K = {K} (vLLM {online['vllm_version']}, "
             f"{online['prompts']:,} held-out prompts)")
    with svg_figure(svg_path, size=(8, 4.6), title=title) as (fig, (ax,)):
        for i, (key, figures) in enumerate(sources.items()):
            name, color = SOURCES[key]
            bars = ax.bar(x + (i - (len(sources) - 1) / 2) * width, figures["acceptance_rate_per_position"],
                          width, color=color, label=f"{name} ({figures['num_drafts']:,} drafts)")
            label_bars(ax, bars)
        bar_axes(ax)
        ax.set_xticks(x, [f"position {k}" for k in x])
        ax.set_xlabel("draft position k (the k-th drafted token)")
        ax.set_ylabel("acceptance rate (share of drafts accepted through k)")
        ax.set_ylim(0, 1.18)
        ax.legend(loc="upper right", ncols=1)


def plot_speed(offline_path, vllm_path, svg_path):
    """Two panels: mean acceptance length (tokens per target forward; 1 without a drafter, K+1 at
    most) by source, and vLLM's decoding speed without and with the drafter, with the speedup."""
    sources = acceptance_sources(offline_path, vllm_path)
    online = sources["vllm"]
    K = online["num_speculative_tokens"]
    with svg_figure(svg_path, ncols=2, size=(11, 4.4), title="What the drafter buys") as (fig, (length, speed)):
        names = [SOURCES[key][0].replace(", ", ",\n").replace(" (", "\n(") for key in sources]
        bars = length.bar(names, [s["mean_acceptance_length"] for s in sources.values()],
                          color=[SOURCES[key][1] for key in sources], width=0.6)
        label_bars(length, bars)
        length.axhline(1, color="#444", ls="--", lw=1, label="without the drafter: 1")
        length.axhline(K + 1, color="#888", ls=":", lw=1, label=f"the most possible: K + 1 = {K + 1}")
        length.set_ylim(0, K + 2)
        length.set_title("Mean acceptance length")
        length.set_ylabel("tokens per target forward pass")
        length.tick_params(axis="x", labelsize=8)
        length.legend(loc="upper center", ncols=2)
        bar_axes(length)
        rates = [online["tokens_per_s_without_speculation"], online["tokens_per_s_with_speculation"]]
        bars = speed.bar(["without the drafter", "with the drafter"], rates, color=["#7f7f7f", "#1f77b4"], width=0.5)
        label_bars(speed, bars, "{:,.0f}")
        speed.set_ylim(0, max(rates) * 1.25)
        speed.set_title(f"vLLM decoding speed, {online['concurrency']} requests at once")
        speed.set_ylabel("generated tokens / s")
        speed.text(0.5, 0.93, f"speedup {online['speedup']:.2f}x; greedy text "
                   + ("unchanged" if online["greedy_text_unchanged"] else "changed"),
                   transform=speed.transAxes, ha="center", fontsize=10, fontweight="bold")
        bar_axes(speed, thousands=True)


def acceptance_table(offline_path, vllm_path):
    """DataFrame, one row per source: acceptance at each position, mean acceptance length, drafts."""
    sources = acceptance_sources(offline_path, vllm_path)
    offline = read_json(offline_path)
    rows = []
    for key, figures in [*sources.items(), ("offline_every_anchor", offline)]:
        name = SOURCES[key][0] if key in SOURCES else "offline, held-out shards, a draft at every anchor"
        row = {"source": name}
        for k, rate in enumerate(figures["acceptance_rate_per_position"], 1):
            row[f"position {k}"] = f"{rate:.3f}"
        row["mean acceptance length"] = f"{figures['mean_acceptance_length']:.2f}"
        row["drafts"] = count(figures["num_drafts"])
        row["accepted tokens"] = count(figures["num_accepted_tokens"])
        rows.append(row)
    return pd.DataFrame(rows)


def write_acceptance_table(offline_path, vllm_path, table_path):
    """The acceptance figures behind the two plots, as numbers (an HTML table)."""
    online = read_json(vllm_path)
    note = (f"Acceptance at position k: the share of drafts whose first k tokens were all accepted. "
            f"Offline and vLLM agree within {online['max_disagreement']:.3f} per position "
            f"(tolerance {online['agreement_tolerance']}). vLLM speed, {online['concurrency']} requests at once: "
            f"{online['tokens_per_s_with_speculation']:,.0f} tokens/s with the drafter, "
            f"{online['tokens_per_s_without_speculation']:,.0f} without ({online['speedup']:.2f}x).")
    table = acceptance_table(offline_path, vllm_path)
    write_tables(table_path, "Acceptance, offline and in vLLM", [(None, table)], note,
                 numeric=set(table.columns) - {"source"})
