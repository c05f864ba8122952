"""The run summary: what went in, what the drafter covers, how often its drafts are accepted."""

import csv
import json

from eaglenest.atomic import atomic_path


def write_summary(tokenize_report, coverage, train_log, offline_metrics, out_path):
    """A short markdown summary of one run (printed by `make demo`)."""
    report = json.load(open(tokenize_report))
    cov = json.load(open(coverage))
    offline = json.load(open(offline_metrics))
    with open(train_log) as f:
        last = list(csv.DictReader(f, delimiter="\t"))[-1]
    per_position = " / ".join(f"{a:.2f}" for a in offline["acceptance_rate_per_position"])
    lines = [
        "# eaglenest run summary",
        "",
        f"- samples: {report['samples_in']} in, {report['samples_out']} tokenized "
        f"({report['truncated']} truncated, rejected: {report['rejected'] or 'none'}); "
        f"{report['tokens']} tokens, {report['generated_tokens']} generated",
        f"- draft vocab: {cov['draft_vocab_size']} of {cov['target_vocab_size']} ids, "
        f"covering {cov['coverage']:.1%} of generated tokens",
        "- training: final " + ", ".join(f"{k} {v}" for k, v in last.items()),
        f"- offline (held-out, K={offline['num_speculative_tokens']}): acceptance per position "
        f"{per_position}, mean acceptance length {offline['mean_acceptance_length']:.2f}",
    ]
    text = "\n".join(lines) + "\n"
    with atomic_path(out_path) as tmp:
        tmp.write_text(text)
