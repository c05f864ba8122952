"""The Evaluation figures and tables: per suite and temperature, vLLM's acceptance per position
next to the offline estimate on the same text (the proof that vLLM runs the drafter as trained),
and the speed-up against K per concurrency (what to serve with); every run as numbers."""

from itertools import product

import matplotlib
import numpy as np
import pandas as pd

from eaglenest.report.common import (CHOSEN, DASH, SOURCES, bar_axes, count, label_bars, read_json, svg_figure,
                                     write_tables)
from eaglenest.workflow.config import HELDOUT_SUITE

ERROR_BARS = {"ecolor": "#333", "capsize": 3, "elinewidth": 1}
MARKERS = "osD^v"  # one per concurrency in the speed figure, besides its shade


def suite_names(online):
    """The suites in the order they ran: the held-out split first (vllm_metrics.json's "suites"
    has its keys sorted)."""
    names = list(dict.fromkeys(r["suite"] for r in online["runs"]))
    return sorted(names + [s for s in online["suites"] if s not in names], key=lambda s: s != HELDOUT_SUITE)


def panels(online):
    """[(suite, temperature)] of vllm_metrics.json's grid, one panel each: suites row by row,
    temperatures across."""
    return list(product(suite_names(online), online["temperatures"]))


def runs_at(online, suite, temperature, K=None):
    """The runs of one (suite, temperature), at K = `K` or every K, by concurrency then K."""
    runs = [r for r in online["runs"] if r["suite"] == suite and r["temperature"] == temperature
            and K in (None, r["num_speculative_tokens"])]
    return sorted(runs, key=lambda r: (r["concurrency"], r["num_speculative_tokens"]))


def concurrency_colors(levels):
    """{concurrency: color}: vLLM's blue alone, or its shades, darkest at the fewest requests at once."""
    levels = sorted(levels)
    if len(levels) == 1:
        return {levels[0]: SOURCES["vllm"][1]}
    shades = matplotlib.colormaps["Blues"]
    return {c: shades(0.95 - 0.5 * i / (len(levels) - 1)) for i, c in enumerate(levels)}


def at_once(c):
    return f"{c} request{'' if c == 1 else 's'} at once"


def panel_title(online, suite, temperature):
    return f"{suite}, temperature {temperature:g} ({online['suites'][suite]:,} prompts)"


def _grid_size(online, width, height):
    """(rows, columns, figure size) of the panels' grid: `width` x `height` inches a panel, room for
    the legend; never narrower than the title and the legend (one panel alone)."""
    rows, cols = len(online["suites"]), len(online["temperatures"])
    return rows, cols, (max(width * cols + 0.6, 10.0), height * rows + 1.3)


def _outer_labels(axes, cols, xlabel, ylabel):
    """Axis labels on the bottom row and the left column only (the panels share their scales)."""
    for i, ax in enumerate(axes):
        if i % cols == 0:
            ax.set_ylabel(ylabel)
        if i >= len(axes) - cols:
            ax.set_xlabel(xlabel)


def _figure_legend(fig, axes):
    """One legend for every panel, under them: each label once, in the order first drawn."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=min(len(handles), 3))


def _acceptance_bars(online, offline, suite, temperature, K, colors):
    """[(label, rates, color, error bars or None)] of one panel: vLLM's runs at K (one per
    concurrency), the offline estimate on their text (± eval.agreement_standard_errors standard
    errors above temperature 0) and, held out at temperature 0, the offline held-out shards."""
    runs = runs_at(online, suite, temperature, K)
    bars = [(f"vLLM, {at_once(r['concurrency'])}", r["acceptance_rate_per_position"], colors[r["concurrency"]], None)
            for r in runs]
    if runs:
        same = runs[0]["offline"]  # the estimate on the baseline's text, the same for every concurrency
        z = online["agreement"]["standard_errors"]
        errors = [z * se for se in same["standard_error_per_position"]] if temperature > 0 else None
        bars.append((*SOURCES["offline_same_text"][:1], same["acceptance_rate_per_position"],
                     SOURCES["offline_same_text"][1], errors))
    if suite == HELDOUT_SUITE and temperature == 0:
        bars.append((f"{SOURCES['offline_heldout'][0]}, at vLLM's anchors",
                     offline["served"]["acceptance_rate_per_position"], SOURCES["offline_heldout"][1], None))
    return bars


def _ceiling_marks(ax, online, suite, temperature, K, span):
    """The ceiling of one panel (the same for every concurrency) as a line over each position's
    group of bars, `span` wide."""
    runs = runs_at(online, suite, temperature, K)
    if runs:
        label, color = SOURCES["ceiling"]
        positions = np.arange(1, K + 1)
        ax.hlines(runs[0]["ceiling_per_position"], positions - span / 2, positions + span / 2, colors=color, lw=2,
                  linestyles="dashed", label=label, zorder=4)


def plot_acceptance(offline_path, vllm_path, svg_path):
    """Small multiples, one panel per suite and temperature: grouped bars at each draft position k,
    the share of drafts accepted through k, at the largest K: vLLM's runs, the offline estimate on
    the same text and (held out, greedy) the offline held-out shards; a dashed line over each
    group marks the ceiling there (what an oracle drafting the target's argmax gets on the same
    text). Level bars: vLLM runs the drafter as trained; bars under the line: room to learn."""
    online, offline = read_json(vllm_path), read_json(offline_path)
    K = max(online["num_speculative_tokens"])
    colors = concurrency_colors(online["concurrency"])
    rows, cols, size = _grid_size(online, 5.2, 3.3)
    title = (f"Acceptance per position at K = {K}, vLLM {online['vllm_version']} and offline "
             f"(at most {online['max_tokens']:,} tokens per prompt)")
    with svg_figure(svg_path, nrows=rows, ncols=cols, size=size, title=title, sharey=True) as (fig, axes):
        for ax, (suite, temperature) in zip(axes, panels(online)):
            bars = _acceptance_bars(online, offline, suite, temperature, K, colors)
            width = 0.84 / max(len(bars), 1)
            for i, (label, rates, color, errors) in enumerate(bars):
                x = np.arange(1, len(rates) + 1) + (i - (len(bars) - 1) / 2) * width
                drawn = ax.bar(x, rates, width, color=color, label=label, yerr=errors, error_kw=ERROR_BARS)
                crowded = len(bars) * K > 12  # upright labels would run into each other; above any error bar
                label_bars(ax, drawn, fontsize=6 if crowded else 7, rotation=90 if crowded else 0)
            _ceiling_marks(ax, online, suite, temperature, K, 0.84)
            if temperature > 0 and bars:  # the error bars' legend entry
                ax.errorbar([np.nan], [np.nan], yerr=[1], fmt="none", **ERROR_BARS,
                            label=f"± {online['agreement']['standard_errors']:g} standard errors of the "
                                  "offline-vLLM gap (temperature > 0)")
            if not bars:
                ax.text(0.5, 0.5, "no runs", transform=ax.transAxes, ha="center")
            bar_axes(ax)
            ax.set_title(panel_title(online, suite, temperature), fontsize=10)
            ax.set_xticks(np.arange(1, K + 1), [f"position {k}" for k in range(1, K + 1)])
            ax.set_ylim(0, 1.2)
        _outer_labels(axes, cols, "draft position k (the k-th drafted token)", "share of drafts accepted through k")
        _figure_legend(fig, axes)


def _speed_panel(ax, online, suite, temperature, colors):
    """One (suite, temperature): the speed-up at each K, a line per concurrency, and the
    recommended K of each concurrency ringed. -> the recommendations, for the panel's title."""
    best = {r["concurrency"]: r for r in online["recommended"]
            if (r["suite"], r["temperature"]) == (suite, temperature)}
    for i, c in enumerate(sorted(colors)):
        runs = [r for r in runs_at(online, suite, temperature) if r["concurrency"] == c]
        ax.plot([r["num_speculative_tokens"] for r in runs], [r["speedup"] for r in runs], color=colors[c], lw=2,
                marker=MARKERS[i % len(MARKERS)], markersize=6, label=at_once(c))
    for c, b in sorted(best.items()):
        ax.scatter([b["num_speculative_tokens"]], [b["speedup"]], s=190, facecolors="none", edgecolors=CHOSEN,
                   lw=1.8, zorder=3, label="recommended K: the best measured speed-up (in the title)")
    return [f"{c} at once: " + (f"K={b['num_speculative_tokens']}, {b['speedup']:.2f}x" if b["speculation_pays"]
                                else f"does not pay (K={b['num_speculative_tokens']}: {b['speedup']:.2f}x)")
            for c, b in sorted(best.items())]


def plot_speed(offline_path, vllm_path, svg_path):
    """Small multiples, one panel per suite and temperature: vLLM's speed-up (tokens/s with the
    drafter over without) against K, one line per concurrency; the dashed line at 1x is where
    speculation stops paying, and the ring marks the K to serve with."""
    online = read_json(vllm_path)
    Ks = online["num_speculative_tokens"]
    colors = concurrency_colors(online["concurrency"])
    rows, cols, size = _grid_size(online, 5.2, 3.3)
    top = max([r["speedup"] for r in online["runs"]] + [1])
    title = f"Speed-up against K, vLLM {online['vllm_version']} (tokens/s with the drafter / without)"
    with svg_figure(svg_path, nrows=rows, ncols=cols, size=size, title=title, sharey=True) as (fig, axes):
        for ax, (suite, temperature) in zip(axes, panels(online)):
            best = _speed_panel(ax, online, suite, temperature, colors)
            ax.axhline(1, color="#444", ls="--", lw=1, label="1x: speculation does not pay below")
            lines = [" · ".join(best[i:i + 2]) for i in range(0, len(best), 2)]  # two concurrencies a line
            ax.set_title("\n".join([panel_title(online, suite, temperature), *lines]), fontsize=9.5)
            ax.set_xticks(Ks, [str(k) for k in Ks])
            ax.set_xlim(min(Ks) - 0.5, max(Ks) + 0.5)
            ax.set_ylim(0, top * 1.2)
        _outer_labels(axes, cols, "K (num_speculative_tokens: tokens drafted per step)", "speed-up (x)")
        _figure_legend(fig, axes)


def _rates(rates, digits=3):
    """Figures per position, "0.929 / 0.895 / 0.854" (None: a dash); no-break spaces keep a table
    cell on one line."""
    return "\u00a0/\u00a0".join(DASH if r is None else f"{r:.{digits}f}" for r in rates)


def _greedy(run):
    """How speculation changed the baseline's greedy text (temperature 0 only)."""
    if "divergent_share" not in run:
        return DASH
    return "unchanged" if run["greedy_text_unchanged"] else f"{run['divergent_share']:.0%} of prompts changed"


def runs_table(online):
    """DataFrame, one row per vLLM run: its acceptance, the offline estimate on the same text and
    the tolerance between them, and its speed without and with the drafter."""
    rows = []
    order = suite_names(online)
    for r in sorted(online["runs"], key=lambda r: (order.index(r["suite"]), r["temperature"],
                                                   r["num_speculative_tokens"], r["concurrency"])):
        rows.append({
            "suite": r["suite"], "temperature": f"{r['temperature']:g}", "K": str(r["num_speculative_tokens"]),
            "concurrency": str(r["concurrency"]), "drafts": count(r["num_drafts"]),
            "acceptance per position": _rates(r["acceptance_rate_per_position"]),
            "mean acceptance length": f"{r['mean_acceptance_length']:.2f}",
            "ceiling": _rates(r["ceiling_per_position"]),
            "share of ceiling": _rates(r["share_of_ceiling_per_position"], 2),
            "offline, same text": _rates(r["offline"]["acceptance_rate_per_position"]),
            "tolerance per position": _rates(r["tolerance_per_position"]),
            "largest gap": f"{r['max_disagreement']:.3f}", "agrees": "yes" if r["agrees"] else "NO",
            "greedy text": _greedy(r),
            "tokens/s without": f"{r['tokens_per_s_without_speculation']:,.0f}",
            "tokens/s with": f"{r['tokens_per_s_with_speculation']:,.0f}", "speed-up": f"{r['speedup']:.2f}x",
        })
    return pd.DataFrame(rows)


def recommended_table(online):
    """DataFrame, one row per (suite, temperature, concurrency): the K with the best measured
    speed-up, or that speculation does not pay there, and its acceptance beside the ceiling."""
    return pd.DataFrame([{
        "suite": r["suite"], "temperature": f"{r['temperature']:g}", "concurrency": str(r["concurrency"]),
        "serve with": f"K = {r['num_speculative_tokens']}" if r["speculation_pays"]
        else f"no drafter: does not pay (best K = {r['num_speculative_tokens']})",
        "speed-up": f"{r['speedup']:.2f}x", "mean acceptance length": f"{r['mean_acceptance_length']:.2f}",
        "acceptance per position": _rates(r["acceptance_rate_per_position"]),
        "ceiling": _rates(r["ceiling_per_position"]),
        "share of ceiling": _rates(r["share_of_ceiling_per_position"], 2),
    } for r in online["recommended"]])


def heldout_table(offline):
    """DataFrame of the offline held-out shards: at vLLM's anchors ("served"), at every anchor,
    and the ceiling at temperature 0 on the same text (an oracle drafting the target's argmax)."""
    rows = []
    ceiling = {"acceptance_rate_per_position": offline["served"]["ceiling_per_position"]}
    ceiling["mean_acceptance_length"] = 1 + sum(ceiling["acceptance_rate_per_position"])
    for name, figures in [("at vLLM's anchors (served)", offline["served"]), ("a draft at every anchor", offline),
                          ("ceiling, at its own anchors", ceiling)]:
        row = {"drafts from": name}
        for k, rate in enumerate(figures["acceptance_rate_per_position"], 1):
            row[f"position {k}"] = f"{rate:.3f}"
        row["mean acceptance length"] = f"{figures['mean_acceptance_length']:.2f}"
        row["drafts"] = count(figures["num_drafts"]) if "num_drafts" in figures else DASH
        row["accepted tokens"] = count(figures["num_accepted_tokens"]) if "num_accepted_tokens" in figures else DASH
        rows.append(row)
    return pd.DataFrame(rows)


def agreement_sentence(online):
    """The agreement check in one sentence: how many runs agree, the largest gap and the tolerances."""
    runs, agreement = online["runs"], online["agreement"]
    agree = sum(r["agrees"] for r in runs)
    return (f"Offline and vLLM agree in {agree} of {len(runs)} runs (largest gap "
            f"{max(r['max_disagreement'] for r in runs):.3f} per position; tolerance {agreement['greedy_tolerance']} "
            f"at temperature 0, above it {agreement['z']:.2f} standard errors: "
            f"{agreement['standard_errors']:g} family-wise over {agreement['sampled_comparisons']} positions).")


def write_acceptance_table(offline_path, vllm_path, table_path):
    """Every vLLM run, the K to serve with, and the offline held-out figures, as numbers (an HTML page)."""
    online, offline = read_json(vllm_path), read_json(offline_path)
    suites = ", ".join(f"{name} ({online['suites'][name]:,} prompts)" for name in suite_names(online))
    note = (f"vLLM {online['vllm_version']}, suites {suites}, at most {online['max_tokens']:,} tokens per prompt. "
            "Acceptance at position k: the share of drafts whose first k tokens were all accepted; mean acceptance "
            "length: 1 + their sum, tokens per target forward pass. Ceiling: what an oracle that drafts the target's "
            "own argmax would have accepted on the same text (1 at temperature 0; above it, vLLM's rejection sampler "
            "accepts a draft with the target's probability of it); share of ceiling: acceptance / ceiling. "
            + agreement_sentence(online)
            + " Speed-up: tokens/s with the drafter over tokens/s without, at the same concurrency.")
    runs, best, heldout = runs_table(online), recommended_table(online), heldout_table(offline)
    tables = [("Every run: suite × temperature × K × concurrency", runs),
              ("The K to serve with: the best measured speed-up per suite, temperature and concurrency", best),
              (f"Offline, held-out shards (K = {offline['num_speculative_tokens']})", heldout)]
    numeric = {"K", "concurrency", "drafts", "mean acceptance length", "largest gap", "tokens/s without",
               "tokens/s with", "speed-up", "accepted tokens", *[c for c in heldout if c.startswith("position")]}
    write_tables(table_path, "Acceptance and speed, offline and in vLLM", tables, note, numeric=numeric)
