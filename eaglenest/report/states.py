"""The Hidden states figure: tokens and extraction rate per shard (manifest.json and the
hidden_states jobs' benchmark files)."""

from pathlib import Path

import numpy as np

from eaglenest.plan.rates import read_benchmark
from eaglenest.report.common import bar_axes, read_json, svg_figure

MAX_TICKS = 24  # more shards than this: no label per bar


def shard_rows(manifest_path, benchmark_dir):
    """[(shard id, samples, tokens, seconds or None)] in manifest order; the seconds from the
    shard's benchmark file (benchmark_dir/shard_NNNNN.tsv), None where it has none."""
    rows = []
    for shard in read_json(manifest_path)["shards"]:
        shard_id = Path(shard["file"]).stem.removeprefix("shard_")
        bench = read_benchmark(Path(benchmark_dir) / f"shard_{shard_id}.tsv")
        rows.append((shard_id, len(shard["sample_ids"]), shard["num_tokens"], bench and bench["s"]))
    return rows


def plot_shards(manifest_path, benchmark_dir, svg_path):
    """Two panels over the shards: tokens in each, and tokens per second of wall time of the job
    that extracted it (model load included): an unbalanced split or a slow shard shows at once."""
    rows = shard_rows(manifest_path, benchmark_dir)
    x = np.arange(len(rows))
    tokens = np.array([r[2] for r in rows], dtype=float)
    rates = np.array([r[2] / r[3] if r[3] else np.nan for r in rows])
    with svg_figure(svg_path, ncols=2, size=(10, 4.2),
                    title=f"Hidden-state shards: {len(rows):,} shards, {int(tokens.sum()):,} tokens") as (fig, axes):
        left, right = axes
        left.bar(x, tokens, color="#1f77b4")
        left.axhline(tokens.mean(), color="#444", ls="--", lw=1, label=f"mean {tokens.mean():,.0f}")
        left.set_title("Tokens per shard")
        left.set_ylabel("tokens")
        right.bar(x, np.nan_to_num(rates), color="#2ca02c")
        if np.isfinite(rates).any():
            mean = np.nanmean(rates)
            right.axhline(mean, color="#444", ls="--", lw=1, label=f"mean {mean:,.0f} tokens/s")
        missing = int(np.isnan(rates).sum())
        right.set_title("Extraction rate per shard" + (f" ({missing} without a benchmark)" if missing else ""))
        right.set_ylabel("tokens / s (job wall time)")
        for ax in axes:
            bar_axes(ax, thousands=True)
            ax.set_ylim(0, ax.get_ylim()[1] * 1.15)  # room for the legend above the bars
            ax.set_xlabel("shard")
            if len(rows) <= MAX_TICKS:
                ax.set_xticks(x, [r[0] for r in rows], rotation=45 if len(rows) > 8 else 0, fontsize=8)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="upper right")
