"""What the report's figures and tables share: one look, numbers written one way, atomic files."""

import contextlib
import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window: the report rule runs headless

import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import StrMethodFormatter  # noqa: E402

from eaglenest.workflow import units  # noqa: E402
from eaglenest.workflow.atomic import atomic_path  # noqa: E402

# Text stays text in the SVG (searchable, sharp at any zoom); fixed ids and no date, so the same
# data gives the same file.
STYLE = {
    "svg.fonttype": "none",
    "svg.hashsalt": "eaglenest",
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 9,
    "legend.framealpha": 0.85,
}
# One color per source of acceptance figures, the same in every plot (vLLM's runs: shades of its
# blue, one per concurrency, from eaglenest.report.evaluate)
SOURCES = {
    "vllm": ("vLLM (its spec-decode counters)", "#1f77b4"),
    "offline_same_text": ("offline, on the baseline's text", "#ff7f0e"),
    "offline_heldout": ("offline, held-out shards", "#2ca02c"),
    "ceiling": ("ceiling", "#222222"),  # of a draft method, on the baseline's text: its name follows
}
CHOSEN = "#d62728"  # what the config chose (draft vocab size, max_seq_len)
TABLE_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; font-size: 14px;
       color: #222; margin: 1em; }
h2 { font-size: 16px; margin: 0 0 .4em; }
h3 { font-size: 14px; margin: 1.2em 0 .4em; }
p.note { color: #555; max-width: 60em; }
table.report { border-collapse: collapse; margin: .5em 0 1em; }
table.report th, table.report td { padding: 4px 10px; border-bottom: 1px solid #ddd; vertical-align: top; }
table.report th { background: #f3f3f3; text-align: left; font-weight: 600; }
table.report td { text-align: left; }
table.report tbody tr:nth-child(even) { background: #fafafa; }
"""
DASH = "—"  # a figure the run has no value for


def read_json(path):
    with open(path) as f:
        return json.load(f)


@contextlib.contextmanager
def svg_figure(path, *, nrows=1, ncols=1, size=(7.5, 4.5), title=None, sharey=False):
    """Yield (figure, axes list, row by row) in the report's style; on leaving, write the figure
    as SVG at `path`, atomically. sharey: one y scale for every panel, so that they compare."""
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=size, layout="constrained")
        axes = list(fig.subplots(nrows, ncols, squeeze=False, sharey=sharey).flat)
        yield fig, axes
        if title:
            fig.suptitle(title, fontsize=12, fontweight="bold")
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="svg", metadata={"Date": None})


def label_bars(ax, bars, fmt="{:.2f}", fontsize=8, **kwargs):
    """Write each bar's value above it, so that a reader needs no ruler."""
    ax.bar_label(bars, labels=[fmt.format(b.get_height()) for b in bars], padding=2, fontsize=fontsize, **kwargs)


def bar_axes(ax, thousands=False):
    """A bar chart's axes: horizontal grid lines only; counts with thousands separators."""
    ax.grid(axis="x", visible=False)
    if thousands:
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))


def count(n):
    """An integer with thousands separators, or a dash when missing."""
    return DASH if n is None else f"{int(n):,}"


def percent(x, digits=2):
    return DASH if x is None else f"{100 * x:.{digits}f}%"


def duration(seconds):
    """A time as units.duration writes it; a dash for one not measured."""
    return DASH if seconds is None or pd.isna(seconds) else units.duration(seconds)


def size(n):
    """Bytes as units.size writes them (decimal units, docs/ARCHITECTURE.md "Units for people"); a dash for none."""
    return DASH if n is None else units.size(n)


def _numeric_css(table_id, frame, numeric):
    """CSS right-aligning the cells of the `numeric` columns of one table (digits line up)."""
    return "".join(f"#{table_id} td:nth-child({i + 1}) {{ text-align: right; white-space: nowrap; "
                   "font-variant-numeric: tabular-nums; }\n"
                   for i, column in enumerate(frame.columns) if column in numeric)


def write_tables(path, title, tables, note=None, numeric=()):
    """Write an HTML page of pandas tables: `tables` is [(heading or None, DataFrame)], every cell
    already a string (formatted by the functions above), `note` a paragraph under the title,
    `numeric` the names of the columns to right-align."""
    parts, css = [f"<h2>{html.escape(title)}</h2>"], TABLE_CSS
    if note:
        parts.append(f'<p class="note">{html.escape(note)}</p>')
    for i, (heading, frame) in enumerate(tables):
        if heading:
            parts.append(f"<h3>{html.escape(heading)}</h3>")
        parts.append(frame.to_html(index=False, border=0, classes="report", table_id=f"t{i}", na_rep=DASH))
        css += _numeric_css(f"t{i}", frame, numeric)
    page = (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{css}</style>\n</head>\n<body>\n"
        + "\n".join(parts)
        + "\n</body>\n</html>\n"
    )
    with atomic_path(path) as tmp:
        tmp.write_text(page, encoding="utf-8")
