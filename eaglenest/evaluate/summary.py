"""The run summary: what went in, what the drafter covers, how often its drafts are accepted."""

import csv
import json

from eaglenest.workflow.atomic import atomic_path


def _rates(metrics):
    return " / ".join(f"{a:.2f}" for a in metrics["acceptance_rate_per_position"])


def write_summary(tokenize_report, coverage, train_log, offline_metrics, vllm_metrics, out_path):
    """A short markdown summary of one run (printed by `make demo`)."""
    report = json.load(open(tokenize_report))
    cov = json.load(open(coverage))
    offline = json.load(open(offline_metrics))
    online = json.load(open(vllm_metrics))
    served = offline["served"]
    with open(train_log) as f:
        last = list(csv.DictReader(f, delimiter="\t"))[-1]
    lines = [
        "# eaglenest run summary",
        "",
        f"- samples: {report['samples_in']} in, {report['samples_out']} tokenized "
        f"({report['truncated']} truncated, rejected: {report['rejected'] or 'none'}); "
        f"{report['tokens']} tokens, {report['generated_tokens']} generated",
        f"- draft vocab: {cov['draft_vocab_size']} of {cov['target_vocab_size']} ids, "
        f"covering {cov['coverage']:.1%} of generated tokens",
        "- training: final " + ", ".join(f"{k} {v}" for k, v in last.items()),
        "",
        f"| acceptance, K={online['num_speculative_tokens']} | per position | mean acceptance length | drafts |",
        "|---|---|---|---|",
        f"| vLLM {online['vllm_version']}, {online['prompts']} held-out prompts | {_rates(online)} "
        f"| {online['mean_acceptance_length']:.2f} | {online['num_drafts']} |",
        f"| offline, on vLLM's greedy text | {_rates(online['offline_on_vllm_text'])} "
        f"| {online['offline_on_vllm_text']['mean_acceptance_length']:.2f} "
        f"| {online['offline_on_vllm_text']['num_drafts']} |",
        f"| offline, on the held-out shards | {_rates(served)} | {served['mean_acceptance_length']:.2f} "
        f"| {served['num_drafts']} |",
        "",
        f"- vLLM speed: {online['tokens_per_s_with_speculation']:.0f} tokens/s with the drafter, "
        f"{online['tokens_per_s_without_speculation']:.0f} without: {online['speedup']:.2f}x; "
        f"greedy text unchanged; offline and vLLM agree within {online['max_disagreement']:.3f} per position "
        f"(tolerance {online['agreement_tolerance']})",
    ]
    text = "\n".join(lines) + "\n"
    with atomic_path(out_path) as tmp:
        tmp.write_text(text)
