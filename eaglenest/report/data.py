"""The Data figures: what the samples look like (lengths, truncation) and how much of the generated
text a draft vocabulary of each size covers (from token_freq.pt)."""

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter

from eaglenest.report.common import CHOSEN, count, percent, read_json, svg_figure, write_tables

# Draft vocabulary sizes people pick for real targets (published EAGLE-3 drafters use about 32K)
STANDARD_SIZES = (8192, 16384, 32768, 65536)


def load_counts(freq_path):
    """token_freq.pt: int64 [target vocab] counts of each id among the generated tokens."""
    import torch

    return torch.load(freq_path).numpy()


def coverage_curve(counts):
    """float [V]: at index N-1, the share of generated tokens that the N most frequent ids cover
    (what a draft vocabulary of N ids covers: vocab_map keeps the top N)."""
    ranked = np.sort(np.asarray(counts, dtype=np.int64))[::-1]
    return np.cumsum(ranked) / max(int(ranked.sum()), 1)


def _ids(n, _position=None):
    """An axis tick of ids: 1, 10, 100, 1K, 10K, 100K, 1M."""
    for unit, scale in (("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def _size_name(n):
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def coverage_table(counts, draft_vocab_size):
    """DataFrame, one row per standard size and the chosen one: the ids it keeps (capped at the
    target vocabulary), the share of generated tokens they cover, the tokens they miss."""
    curve = coverage_curve(counts)
    covered_tokens = np.cumsum(np.sort(np.asarray(counts, dtype=np.int64))[::-1])
    vocab, generated = len(curve), int(np.sum(counts))
    rows = []
    for size in sorted({*STANDARD_SIZES, draft_vocab_size}):
        kept = min(size, vocab)
        covered = float(curve[kept - 1])
        notes = []
        if size == draft_vocab_size:
            notes.append("chosen (vocab.draft_vocab_size)")
        if size > vocab:
            notes.append(f"capped: the target has {vocab:,} ids")
        rows.append({
            "draft vocab size": f"{size:,} ({_size_name(size)})" if size % 1024 == 0 else f"{size:,}",
            "ids kept": count(kept),
            "share of the target vocab": percent(kept / vocab, 1),
            "generated tokens covered": percent(covered),
            "generated tokens missed": count(generated - int(covered_tokens[kept - 1])),
            "note": "; ".join(notes),
        })
    return pd.DataFrame(rows)


def write_coverage_table(freq_path, table_path, *, draft_vocab_size):
    """What 8K, 16K, 32K and 64K draft ids would cover, next to the chosen size (an HTML table)."""
    counts = load_counts(freq_path)
    distinct = int(np.count_nonzero(counts))
    note = (f"Out of {int(np.sum(counts)):,} generated tokens ({distinct:,} distinct ids of a target "
            f"vocabulary of {len(counts):,}). A draft vocabulary of N ids keeps the N most frequent; "
            "a token outside it can never be drafted, so its draft is rejected.")
    write_tables(table_path, "Vocabulary coverage by draft vocabulary size",
                 [(None, coverage_table(counts, draft_vocab_size))], note,
                 numeric={"ids kept", "share of the target vocab", "generated tokens covered", "generated tokens missed"})


def plot_coverage(freq_path, svg_path, *, draft_vocab_size):
    """Coverage against draft vocabulary size over the target's whole range (log N), the standard
    sizes the target's vocabulary allows as points, the chosen size marked."""
    counts = load_counts(freq_path)
    curve = coverage_curve(counts)
    vocab = len(curve)
    sizes = np.arange(1, vocab + 1)
    chosen = min(draft_vocab_size, vocab)
    with svg_figure(svg_path, size=(7.5, 4.6),
                    title="Vocabulary coverage against draft vocabulary size") as (fig, (ax,)):
        ax.plot(sizes, 100 * curve, color="#1f77b4", lw=2, label="coverage of the top N ids")
        fits = [n for n in STANDARD_SIZES if n <= vocab]
        if fits:
            ax.plot(fits, [100 * curve[n - 1] for n in fits], "o", color="#444",
                    label=" / ".join(_size_name(n) for n in fits))
            for i, n in enumerate(fits):  # one row each below the curve: neighbours on a log axis are close
                ax.annotate(f"{_size_name(n)}: {100 * curve[n - 1]:.1f}%", (n, 100 * curve[n - 1]),
                            textcoords="offset points", xytext=(0, -20 - 13 * i), ha="center", fontsize=8,
                            arrowprops={"arrowstyle": "-", "color": "#999", "lw": 0.6},
                            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none"})
        ax.axvline(chosen, color=CHOSEN, ls="--", lw=1.2)
        ax.plot([chosen], [100 * curve[chosen - 1]], "D", color=CHOSEN, ms=7,
                label=f"chosen: {draft_vocab_size:,} ids, {100 * curve[chosen - 1]:.1f}%")
        distinct = int(np.count_nonzero(counts))
        ax.axvline(vocab, color="#888", ls=":", lw=1, label=f"target vocabulary: {vocab:,} ids")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_ids))
        ax.set_xlim(1, vocab * 1.15)
        ax.set_ylim(0, 103)
        ax.set_xlabel("draft vocabulary size N (ids, log scale)")
        ax.set_ylabel("generated tokens covered (%)")
        larger = [_size_name(n) for n in STANDARD_SIZES if n > vocab]
        if larger:
            ax.text(0.02, 0.97, f"{', '.join(larger)}: at least the whole target vocabulary "
                    f"({vocab:,} ids): 100%\n{distinct:,} distinct ids were generated",
                    transform=ax.transAxes, va="top", fontsize=8, color="#444")
        ax.legend(loc="lower right")


def sample_lengths(plan_path):
    """(tokens, generated tokens) per tokenized sample, as sorted int arrays, from the plan's
    sample_lengths (the plan read tokenized_data.jsonl: the report does not read it again)."""
    lengths = read_json(plan_path)["sample_lengths"]
    return tuple(np.repeat(*np.array(lengths[key], dtype=np.int64).reshape(-1, 2).T) for key in ("tokens", "generated"))


def _truncation_text(report, max_seq_len, overlong):
    rejected = report["rejected"]
    lines = [f"{report['samples_in']:,} records in, {report['samples_out']:,} samples kept",
             f"{report['truncated']:,} truncated to {max_seq_len:,} tokens (tokenize.overlong: {overlong})",
             f"{rejected.get('too_long', 0):,} dropped as too long",
             f"{rejected.get('no_generated_tokens', 0):,} dropped with no generated token"]
    return "\n".join(lines)


def plot_sample_lengths(plan_path, report_path, svg_path, *, max_seq_len, overlong):
    """Histogram of sample lengths (whole sample and its generated part: plan.json), with
    max_seq_len marked and how many samples were truncated or dropped (tokenize_report.json)."""
    lengths, generated = sample_lengths(plan_path)
    report = read_json(report_path)
    top = max(max_seq_len, int(lengths.max()) if len(lengths) else 1)
    bins = np.linspace(0, top * 1.02, 51)
    with svg_figure(svg_path, size=(7.5, 4.6), title="Sample lengths after tokenization") as (fig, (ax,)):
        ax.hist(lengths, bins=bins, color="#1f77b4", alpha=0.75, label="whole sample (prompt + response)")
        ax.hist(generated, bins=bins, histtype="step", color="#ff7f0e", lw=1.6,
                label="generated tokens (loss_mask = 1)")
        if report["truncated"]:  # they all end at max_seq_len: the part of its bar they make up
            ax.bar(max_seq_len, report["truncated"], width=bins[1] - bins[0], align="edge", color=CHOSEN,
                   alpha=0.8, label=f"truncated to max_seq_len ({report['truncated']:,})")
        ax.axvline(max_seq_len, color=CHOSEN, ls="--", lw=1.4, label=f"tokenize.max_seq_len = {max_seq_len:,}")
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("samples")
        ax.set_xlim(0, top * 1.04)
        tallest = max([1, *np.histogram(lengths, bins)[0], *np.histogram(generated, bins)[0]])
        ax.set_ylim(0, tallest * 1.6)  # headroom for the legend and the counts
        ax.text(0.98, 0.97, _truncation_text(report, max_seq_len, overlong), transform=ax.transAxes,
                ha="right", va="top", fontsize=8,
                bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "#ccc"})
        ax.legend(loc="upper left", fontsize=8)


def prompt_sources_table(counts_path):
    """DataFrame, one row per source of data.sources (read_prompts' counts file): records read,
    used, dropped by reason, prompts written."""
    counts = read_json(counts_path)
    reasons = list(dict.fromkeys(reason for source in counts["sources"] for reason in source["dropped"]))
    rows = [{"source": source["path"], "shape": source["shape"], "records": count(source["records"]),
             "used": count(source["used"]),
             **{f"dropped: {reason}": count(source["dropped"].get(reason, 0)) for reason in reasons},
             "prompts": count(source["prompts"])} for source in counts["sources"]]
    return pd.DataFrame(rows)


def write_prompt_sources_table(counts_path, table_path):
    """The prompts each source gave and the records it dropped, and why (an HTML table)."""
    frame = prompt_sources_table(counts_path)
    note = (f"{read_json(counts_path)['prompts']:,} prompts in all. A conversation gives one prompt per assistant turn "
            "that follows a user turn (and one when it ends with a user turn); 'duplicate': a record seen before, "
            "'nothing to answer': no assistant turn after a user turn, 'not sampled': left out by the mixture's "
            "weight or count (docs/DATA.md).")
    write_tables(table_path, "Prompts from each source", [(None, frame)], note,
                 numeric=set(frame.columns) - {"source", "shape"})
