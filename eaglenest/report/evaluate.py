"""The Evaluation figures and tables: per suite, temperature and draft method, vLLM's acceptance
per position next to the offline estimate on the same text (the proof that vLLM runs the drafter
as trained) under the method's ceiling; the speed-up against K per concurrency and draft method
(what to serve with); every run as numbers."""

from itertools import groupby, product

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.container import Container

from eaglenest.report.common import (CHOSEN, DASH, SOURCES, bar_axes, count, label_bars, read_json, svg_figure,
                                     write_tables)
from eaglenest.workflow.config import HELDOUT_SUITE

ERROR_BARS = {"ecolor": "#333", "capsize": 3, "elinewidth": 1}
MARKERS = "osD^v"  # one per concurrency in the speed figure (concurrency_markers), besides its shade
# One look per draft method (vLLM's draft_sample_method), the same in both figures' legends: its
# ceiling's line over the acceptance bars, and its speed-up line and markers ("named": in words)
METHOD_LOOKS = {
    "greedy": {"ceiling": "dashed", "line": "solid", "fill": "full", "named": "solid line, filled markers"},
    "probabilistic": {"ceiling": "dotted", "line": "dashed", "fill": "none", "named": "dashed line, open markers"},
}
LEGEND_COLUMNS = 3  # at most; fewer where the figure is too narrow for them
CEILING = "ceiling (of the method)"  # the tables' column of a run's ceiling: its own draft method's


def suite_names(online):
    """The suites in the order they ran: the held-out split first (vllm_metrics.json's "suites"
    has its keys sorted)."""
    names = list(dict.fromkeys(r["suite"] for r in online["runs"]))
    return sorted(names + [s for s in online["suites"] if s not in names], key=lambda s: s != HELDOUT_SUITE)


def method_columns(online):
    """[(temperature, draft method)] that ran, a column of acceptance panels each: by temperature,
    then in the order of vllm_metrics.json's "draft_sample_methods" (at temperature 0 greedy alone:
    the two draft the same there)."""
    ran = {(r["temperature"], r["draft_sample_method"]) for r in online["runs"]}
    return [(t, m) for t in online["temperatures"] for m in online["draft_sample_methods"] if (t, m) in ran]


def runs_at(online, suite, temperature, method=None, K=None):
    """The runs of one (suite, temperature), of draft method `method` or every one, at K = `K` or
    every K; by method, concurrency, K."""
    runs = [r for r in online["runs"] if r["suite"] == suite and r["temperature"] == temperature
            and method in (None, r["draft_sample_method"]) and K in (None, r["num_speculative_tokens"])]
    methods = online["draft_sample_methods"]
    return sorted(runs, key=lambda r: (methods.index(r["draft_sample_method"]), r["concurrency"],
                                       r["num_speculative_tokens"]))


def concurrency_colors(levels):
    """{concurrency: color}: vLLM's blue alone, or its shades, darkest at the fewest requests at once."""
    levels = sorted(levels)
    if len(levels) == 1:
        return {levels[0]: SOURCES["vllm"][1]}
    shades = matplotlib.colormaps["Blues"]
    return {c: shades(0.95 - 0.5 * i / (len(levels) - 1)) for i, c in enumerate(levels)}


def concurrency_markers(levels):
    """{concurrency: marker} of the speed figure's lines, besides their shade."""
    return {c: MARKERS[i % len(MARKERS)] for i, c in enumerate(sorted(levels))}


def at_once(c):
    return f"{c} request{'' if c == 1 else 's'} at once"


def panel_title(online, suite, temperature):
    return f"{suite}, temperature {temperature:g} ({online['suites'][suite]:,} prompts)"


def _figure_size(rows, cols, height):
    """(width, height) in inches of a grid of panels 5.2 inches wide and `height` high, with room
    for the title and the legend; never narrower than the title (one panel alone)."""
    return max(5.2 * cols + 0.6, 10.0), height * rows + 1.3


def _outer_labels(axes, cols, xlabel, ylabel):
    """Axis labels on the bottom row and the left column only (the panels share their scales)."""
    for i, ax in enumerate(axes):
        if i % cols == 0:
            ax.set_ylabel(ylabel)
        if i >= len(axes) - cols:
            ax.set_xlabel(xlabel)


def _figure_legend(fig, axes):
    """One legend for every panel, under them: each label once, in the order first drawn (bars
    and error bars before lines: matplotlib lists them after), in as many columns as fit 90% of the
    figure's width (matplotlib measures the text in its own font, a browser may draw it in one of
    its own: the margin keeps the legend inside the figure in either)."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    handles = dict(sorted(handles.items(), key=lambda item: not isinstance(item[1], Container)))
    for ncols in range(min(len(handles), LEGEND_COLUMNS), 0, -1):
        legend = fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=ncols)
        if ncols == 1 or legend.get_window_extent().width <= 0.9 * fig.bbox.width:
            return
        legend.remove()


def _acceptance_bars(offline, runs, suite, temperature, z, colors):
    """[(label, rates, color, error bars or None)] of one panel, its `runs` at the largest K: vLLM's
    (one per concurrency), the offline estimate of their draft method on their text (± `z`
    standard errors above temperature 0) and, held out at temperature 0, the offline held-out shards."""
    bars = [(f"vLLM, {at_once(r['concurrency'])}", r["acceptance_rate_per_position"], colors[r["concurrency"]], None)
            for r in runs]
    if runs:
        same = runs[0]["offline"]  # the estimate on the baseline's text, the same for every concurrency
        errors = [z * se for se in same["standard_error_per_position"]] if temperature > 0 else None
        bars.append((*SOURCES["offline_same_text"][:1], same["acceptance_rate_per_position"],
                     SOURCES["offline_same_text"][1], errors))
    if suite == HELDOUT_SUITE and temperature == 0:
        bars.append((f"{SOURCES['offline_heldout'][0]}, at vLLM's anchors",
                     offline["served"]["acceptance_rate_per_position"], SOURCES["offline_heldout"][1], None))
    return bars


def _ceiling_marks(ax, run, span):
    """The ceiling of `run`'s draft method (the same for every concurrency) as a line over each
    position's group of bars, `span` wide, in the method's style and named after it."""
    rates, method = run["ceiling_per_position"], run["draft_sample_method"]
    positions = np.arange(1, len(rates) + 1)
    label, color = SOURCES["ceiling"]
    ax.hlines(rates, positions - span / 2, positions + span / 2, colors=color, lw=2,
              linestyles=METHOD_LOOKS[method]["ceiling"], label=f"{label}, {method} drafting: {run['ceiling']}",
              zorder=4)


def plot_acceptance(offline_path, vllm_path, svg_path):
    """Small multiples, one panel per suite, temperature and draft method that ran: grouped bars at
    each draft position k, the share of drafts accepted through k, at the largest K: vLLM's runs,
    the offline estimate on the same text and (held out, temperature 0) the offline held-out
    shards; a line over each group marks the ceiling of the panel's draft method there (what an
    oracle drafting that way gets on the same text). Level bars: vLLM runs the drafter as trained;
    bars under the line: room to learn."""
    online, offline = read_json(vllm_path), read_json(offline_path)
    K = max(online["num_speculative_tokens"])
    colors = concurrency_colors(online["concurrency"])
    columns = method_columns(online)
    z = online["agreement"]["standard_errors"]
    title = (f"Acceptance per position at K = {K}, vLLM {online['vllm_version']} and offline "
             f"(at most {online['max_tokens']:,} tokens per prompt)")
    size = _figure_size(len(online["suites"]), len(columns), 3.6)
    with svg_figure(svg_path, nrows=len(online["suites"]), ncols=len(columns), size=size, title=title,
                    sharey=True) as (fig, axes):
        for ax, (suite, (temperature, method)) in zip(axes, product(suite_names(online), columns)):
            runs = runs_at(online, suite, temperature, method, K)
            bars = _acceptance_bars(offline, runs, suite, temperature, z, colors)
            width = 0.84 / max(len(bars), 1)
            for i, (label, rates, color, errors) in enumerate(bars):
                x = np.arange(1, len(rates) + 1) + (i - (len(bars) - 1) / 2) * width
                drawn = ax.bar(x, rates, width, color=color, label=label, yerr=errors, error_kw=ERROR_BARS)
                crowded = len(bars) * K > 12  # upright labels would run into each other; above any error bar
                label_bars(ax, drawn, fontsize=6 if crowded else 7, rotation=90 if crowded else 0)
            if runs:
                _ceiling_marks(ax, runs[0], 0.84)
            if temperature > 0 and runs:  # the error bars' legend entry
                ax.errorbar([np.nan], [np.nan], yerr=[1], fmt="none", **ERROR_BARS,
                            label=f"± {z:g} standard errors of the offline-vLLM gap")
            if not bars:
                ax.text(0.5, 0.5, "no runs", transform=ax.transAxes, ha="center")
            bar_axes(ax)
            drafting = f"{method} drafting" + (f", ceiling: {runs[0]['ceiling']}" if runs else "")
            ax.set_title(f"{panel_title(online, suite, temperature)}\n{drafting}", fontsize=10)
            ax.set_xticks(np.arange(1, K + 1), [f"position {k}" for k in range(1, K + 1)])
            ax.set_ylim(0, 1.2)
        _outer_labels(axes, len(columns), "draft position k (the k-th drafted token)",
                      "share of drafts accepted through k")
        _figure_legend(fig, axes)


def _speed_key(ax, online, colors, markers):
    """The speed figure's legend entries for its lines: a concurrency's shade and marker, a draft
    method's line and marker fill (drawn empty, once)."""
    for c in sorted(colors):
        ax.plot([], [], color=colors[c], lw=2, marker=markers[c], markersize=6, label=at_once(c))
    for method in online["draft_sample_methods"]:
        look = METHOD_LOOKS[method]
        ax.plot([], [], color="#555", lw=2, ls=look["line"], marker="o", fillstyle=look["fill"], markersize=6,
                label=f"{method} drafting: {look['named']}")


def _recommended(best):
    """One concurrency's recommendation in a speed panel's title."""
    choice, x = f"{best['draft_sample_method']} K={best['num_speculative_tokens']}", f"{best['speedup']:.2f}x"
    return f"{best['concurrency']} at once: " + (f"{choice}, {x}" if best["speculation_pays"]
                                                 else f"does not pay ({choice}: {x})")


def _speed_panel(ax, online, suite, temperature, colors, markers):
    """One (suite, temperature): the speed-up at each K, a line per concurrency and draft method,
    and the recommended (method, K) of each concurrency ringed. -> the recommendations, for the
    panel's title."""
    best = sorted((r for r in online["recommended"] if (r["suite"], r["temperature"]) == (suite, temperature)),
                  key=lambda r: r["concurrency"])
    for (method, c), group in groupby(runs_at(online, suite, temperature),
                                      key=lambda r: (r["draft_sample_method"], r["concurrency"])):
        runs = list(group)
        look = METHOD_LOOKS[method]
        ax.plot([r["num_speculative_tokens"] for r in runs], [r["speedup"] for r in runs], color=colors[c], lw=2,
                ls=look["line"], marker=markers[c], fillstyle=look["fill"], markersize=6)
    for b in best:
        ax.scatter([b["num_speculative_tokens"]], [b["speedup"]], s=190, facecolors="none", edgecolors=CHOSEN,
                   lw=1.8, zorder=3, label="recommended draft method and K: the best measured speed-up (in the title)")
    return [_recommended(b) for b in best]


def plot_speed(offline_path, vllm_path, svg_path):
    """Small multiples, one panel per suite and temperature: vLLM's speed-up (tokens/s with the
    drafter over without) against K, one line per concurrency and draft method; the line at 1x
    is where speculation stops paying, and the ring marks the draft method and K to serve with."""
    online = read_json(vllm_path)
    Ks = online["num_speculative_tokens"]
    colors, markers = concurrency_colors(online["concurrency"]), concurrency_markers(online["concurrency"])
    top = max([r["speedup"] for r in online["runs"]] + [1])
    title = f"Speed-up against K, vLLM {online['vllm_version']} (tokens/s with the drafter / without)"
    rows, cols = len(online["suites"]), len(online["temperatures"])
    height = 3.3 + 0.15 * len(colors)  # a title line per concurrency
    with svg_figure(svg_path, nrows=rows, ncols=cols, size=_figure_size(rows, cols, height), title=title,
                    sharey=True) as (fig, axes):
        _speed_key(axes[0], online, colors, markers)
        for ax, (suite, temperature) in zip(axes, product(suite_names(online), online["temperatures"])):
            best = _speed_panel(ax, online, suite, temperature, colors, markers)
            ax.axhline(1, color="#444", lw=1.2, label="1x: speculation does not pay below")
            ax.set_title("\n".join([panel_title(online, suite, temperature), *best]), fontsize=9.5)
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
    if run["greedy_text_unchanged"]:
        return "unchanged"
    return f"{run['divergent_share']:.0%} of prompts changed, each at a near-tie of the target's logits"


def runs_table(online):
    """DataFrame, one row per vLLM run: its acceptance beside its draft method's ceiling, the
    offline estimate on the same text and the tolerance between them, and its speed without and
    with the drafter."""
    rows = []
    suites, methods = suite_names(online), online["draft_sample_methods"]
    for r in sorted(online["runs"], key=lambda r: (suites.index(r["suite"]), r["temperature"],
                                                   methods.index(r["draft_sample_method"]),
                                                   r["num_speculative_tokens"], r["concurrency"])):
        rows.append({
            "suite": r["suite"], "temperature": f"{r['temperature']:g}", "draft method": r["draft_sample_method"],
            "K": str(r["num_speculative_tokens"]), "concurrency": str(r["concurrency"]),
            "drafts": count(r["num_drafts"]), "acceptance per position": _rates(r["acceptance_rate_per_position"]),
            "mean acceptance length": f"{r['mean_acceptance_length']:.2f}",
            CEILING: _rates(r["ceiling_per_position"]),
            "share of ceiling": _rates(r["share_of_ceiling_per_position"], 2),
            "vLLM, same text": _rates(r["vllm_same_text"]["acceptance_rate_per_position"]),
            "offline, same text": _rates(r["offline"]["acceptance_rate_per_position"]),
            "tolerance per position": _rates(r["tolerance_per_position"]),
            "largest gap": f"{r['max_disagreement']:.3f}", "agrees": "yes" if r["agrees"] else "NO",
            "greedy text": _greedy(r),
            "tokens/s without": f"{r['tokens_per_s_without_speculation']:,.0f}",
            "tokens/s with": f"{r['tokens_per_s_with_speculation']:,.0f}", "speed-up": f"{r['speedup']:.2f}x",
        })
    return pd.DataFrame(rows)


def tool_call_spans_table(online):
    """DataFrame, one row per vLLM run split at the target's tool-call sections (evaluate_vllm with
    tokenize.tool_call_tokens): acceptance on the drafts that start in a tool call beside the rest,
    vLLM's counters split on its own text ("..., vLLM") and the offline replay's on the reference
    text (the drafts counted are its), and vLLM's whole. Empty where no run was split."""
    suites, methods = suite_names(online), online["draft_sample_methods"]
    rows = []
    for r in sorted((r for r in online["runs"] if "tool_call_spans" in r["offline"]),
                    key=lambda r: (suites.index(r["suite"]), r["temperature"], methods.index(r["draft_sample_method"]),
                                   r["num_speculative_tokens"], r["concurrency"])):
        spans, rest = r["offline"]["tool_call_spans"], r["offline"]["outside_tool_call_spans"]
        rows.append({
            "suite": r["suite"], "temperature": f"{r['temperature']:g}", "draft method": r["draft_sample_method"],
            "K": str(r["num_speculative_tokens"]), "concurrency": str(r["concurrency"]),
            "vLLM, whole text": _rates(r["acceptance_rate_per_position"]),
            "tool-call spans, vLLM": _rates(r["tool_call_spans"]["acceptance_rate_per_position"]),
            "tool-call spans": _rates(spans["acceptance_rate_per_position"]), "drafts there": count(spans["num_drafts"]),
            "mean acceptance length there": f"{spans['mean_acceptance_length']:.2f}",
            "elsewhere, vLLM": _rates(r["outside_tool_call_spans"]["acceptance_rate_per_position"]),
            "elsewhere": _rates(rest["acceptance_rate_per_position"]), "drafts elsewhere": count(rest["num_drafts"]),
            "mean acceptance length elsewhere": f"{rest['mean_acceptance_length']:.2f}",
        })
    return pd.DataFrame(rows)


def recommended_table(online):
    """DataFrame, one row per (suite, temperature, concurrency): the draft method and K with the
    best measured speed-up, or that speculation does not pay there (with no method at any K), and
    its acceptance beside its method's ceiling."""
    def choice(r):
        return f"{r['draft_sample_method']}, K = {r['num_speculative_tokens']}"

    return pd.DataFrame([{
        "suite": r["suite"], "temperature": f"{r['temperature']:g}", "concurrency": str(r["concurrency"]),
        "serve with": choice(r) if r["speculation_pays"] else f"no drafter: does not pay (best: {choice(r)})",
        "speed-up": f"{r['speedup']:.2f}x", "mean acceptance length": f"{r['mean_acceptance_length']:.2f}",
        "acceptance per position": _rates(r["acceptance_rate_per_position"]),
        CEILING: _rates(r["ceiling_per_position"]),
        "share of ceiling": _rates(r["share_of_ceiling_per_position"], 2),
    } for r in online["recommended"]])


def heldout_table(offline):
    """DataFrame of the offline held-out shards: at vLLM's anchors ("served"), at every anchor,
    and greedy drafting's ceiling at temperature 0 on the same text (the argmax oracle)."""
    rows = []
    ceiling = {"acceptance_rate_per_position": offline["served"]["ceiling_per_position"]}
    ceiling["mean_acceptance_length"] = 1 + sum(ceiling["acceptance_rate_per_position"])
    spans = [("served, drafts starting in a tool call", offline["served"]["tool_call_spans"]),
             ("served, drafts starting elsewhere", offline["served"]["outside_tool_call_spans"])
             ] if "tool_call_spans" in offline["served"] else []
    for name, figures in [("at vLLM's anchors (served)", offline["served"]), *spans, ("a draft at every anchor", offline),
                          ("ceiling (argmax oracle), at its own anchors", ceiling)]:
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
    """Every vLLM run, the draft method and K to serve with, and the offline held-out figures, as
    numbers (an HTML page)."""
    online, offline = read_json(vllm_path), read_json(offline_path)
    suites = ", ".join(f"{name} ({online['suites'][name]:,} prompts)" for name in suite_names(online))
    note = (f"vLLM {online['vllm_version']}, suites {suites}, at most {online['max_tokens']:,} tokens per prompt. "
            "Acceptance at position k: the share of drafts whose first k tokens were all accepted; mean acceptance "
            "length: 1 + their sum, tokens per target forward pass. Draft method: vLLM's draft_sample_method, "
            "greedy (the drafter's argmax, accepted with the target's probability of it) or probabilistic (a draft "
            "sampled from the drafter, accepted with min(1, p/q)); at temperature 0 the two are the same, and only "
            "greedy runs. Ceiling (of the method): what an oracle drafting the way the run's method does would have "
            "accepted on the same text. "
            + "".join(f"{m.capitalize()} drafting's ceiling, {online['ceilings'][m].rstrip('.')}. "
                      for m in online["draft_sample_methods"])
            + "Greedy's ceiling bounds greedy drafting only: probabilistic drafting can accept more than it. Each "
            "share of ceiling is acceptance / the ceiling of the run's own method. "
            + agreement_sentence(online)
            + " Speed-up: tokens/s with the drafter over tokens/s without, at the same concurrency.")
    runs, best, heldout = runs_table(online), recommended_table(online), heldout_table(offline)
    tables = [("Every run: suite × temperature × draft method × K × concurrency", runs),
              ("What to serve with: the draft method and K with the best measured speed-up per suite, temperature "
               "and concurrency", best),
              (f"Offline, held-out shards (K = {offline['num_speculative_tokens']})", heldout)]
    spans = tool_call_spans_table(online)
    if len(spans):
        tables.insert(2, ("On tool-call spans (section begin to section end) and elsewhere: the drafts of each run "
                          "by where they start, vLLM's on the text it served, the offline replay's on its reference "
                          "text (the same text at temperature 0)", spans))
    numeric = {"K", "concurrency", "drafts", "mean acceptance length", "largest gap", "tokens/s without",
               "tokens/s with", "speed-up", "accepted tokens", *[c for c in heldout if c.startswith("position")],
               "drafts there", "drafts elsewhere", "mean acceptance length there", "mean acceptance length elsewhere"}
    write_tables(table_path, "Acceptance and speed, offline and in vLLM", tables, note, numeric=numeric)
