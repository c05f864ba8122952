"""The Training figure: loss and accuracy of each training-time-test step against the optimizer
step (train_log.tsv), with held-out figures where the log has them."""

import re

import pandas as pd

from eaglenest.report.common import svg_figure

STEP_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]


def read_train_log(path):
    """train_log.tsv as a DataFrame (columns: step, epoch, lr, loss, loss_k, acc_k ..., and
    heldout_loss_k / heldout_acc_k where training measures them)."""
    return pd.read_csv(path, sep="\t")


def ttt_steps(frame, metric):
    """The TTT step indices k with a `{metric}_k` column, ascending."""
    return sorted(int(m[1]) for c in frame.columns if (m := re.fullmatch(rf"{metric}_(\d+)", c)))


def _panel(ax, frame, metric, title, ylabel):
    for k in ttt_steps(frame, metric):
        color = STEP_COLORS[k % len(STEP_COLORS)]
        ax.plot(frame["step"], frame[f"{metric}_{k}"], color=color, lw=1.3, label=f"TTT step {k + 1}, training")
        heldout = f"heldout_{metric}_{k}"
        if heldout in frame:
            points = frame[["step", heldout]].dropna()
            ax.plot(points["step"], points[heldout], "o--", color=color, ms=4, lw=1,
                    label=f"TTT step {k + 1}, held out")
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_xlim(0, max(int(frame["step"].max()), 1))


def plot_training(train_log_path, svg_path):
    """Two panels: the loss of each TTT step and its accuracy (the drafter's argmax equals the
    target's), each against the optimizer step, epoch starts dotted."""
    frame = read_train_log(train_log_path)
    epochs = int(frame["epoch"].max()) + 1 if len(frame) else 0
    title = f"Drafter training: {int(frame['step'].max()) if len(frame) else 0:,} optimizer steps, {epochs} epochs"
    with svg_figure(svg_path, ncols=2, size=(11, 4.4), title=title) as (fig, (loss, acc)):
        _panel(loss, frame, "loss", "Loss per TTT step", "cross-entropy against the target (nats / token)")
        loss.set_ylim(bottom=0)
        _panel(acc, frame, "acc", "Accuracy per TTT step", "top-1 agreement with the target (share)")
        acc.set_ylim(0, 1.02)
        starts = frame.groupby("epoch")["step"].min().iloc[1:] if 1 < epochs <= 50 else []
        for ax in (loss, acc):
            for i, start in enumerate(starts):
                ax.axvline(start, color="#bbb", lw=0.8, ls=":", label="epoch start" if i == 0 else None)
        loss.legend(loc="upper right")
        acc.legend(loc="lower right")
