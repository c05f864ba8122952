"""The run summary: what went in, what the drafter covers, how often its drafts are accepted."""

import csv
import json

from eaglenest.workflow.atomic import atomic_path


def latency_prompts(online):
    """Which prompts the concurrencies ran: the largest every one, the others the first few at
    temperature 0 (every one above it)."""
    top = max(online["concurrency"])
    fewer = [r["prompts"] for r in online["runs"] if r["concurrency"] < top and r["temperature"] == 0]
    return (f" ({top} at once on every prompt, fewer on at most the first {max(fewer)} at temperature 0)"
            if fewer else "")


def _rates(metrics, field="acceptance_rate_per_position"):
    return " / ".join("-" if a is None else f"{a:.2f}" for a in metrics[field])


def engine_label(run):
    """How a drafter engine is named in the summary: its draft method and K."""
    return f"{run['draft_sample_method']} K={run['num_speculative_tokens']}"


def serving_table(online):
    """Per suite, temperature and concurrency: the draft method and K with the best measured
    speed-up, its acceptance beside its method's ceiling on the same text, every (method, K)'s
    speed-up, and plainly where speculation does not pay (no method, no K)."""
    runs = online["runs"]
    lines = [f"## In vLLM {online['vllm_version']}: the draft method and K to serve with", "",
             "| suite | temperature | concurrency | best draft method, K | speed-up | acceptance per position "
             "| ceiling (of the method) | share of that ceiling | mean acceptance length | offline, same text "
             "| speed-up by method and K |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    losing = []
    for best in online["recommended"]:
        same = [r for r in runs if (r["suite"], r["temperature"], r["concurrency"])
                == (best["suite"], best["temperature"], best["concurrency"])]
        run = next(r for r in same if engine_label(r) == engine_label(best))
        by_engine = ", ".join(f"{engine_label(r)} {r['speedup']:.2f}x" for r in same)
        verdict = f"{best['speedup']:.2f}x" + ("" if best["speculation_pays"] else " (does not pay)")
        lines.append(f"| {best['suite']} | {best['temperature']:g} | {best['concurrency']} | {engine_label(best)} "
                     f"| {verdict} | {_rates(run)} | {run['ceiling']}: {_rates(run, 'ceiling_per_position')} "
                     f"| {_rates(run, 'share_of_ceiling_per_position')} | {run['mean_acceptance_length']:.2f} "
                     f"| {_rates(run['offline'])} | {by_engine} |")
        if not best["speculation_pays"]:
            losing.append(f"{best['suite']} at temperature {best['temperature']:g}, concurrency {best['concurrency']} "
                          f"(best: {engine_label(best)}, {best['speedup']:.2f}x)")
    lines.append("")
    if losing:
        lines.append("- speculation does not pay with any draft method or K, serve without the drafter: "
                     + "; ".join(losing))
    else:
        lines.append("- speculation pays in every measured setting")
    lines += [f"- ceiling of {method}: {description}" for method, description in online["ceilings"].items()]
    agreement = online["agreement"]
    worst = max(r["max_disagreement"] for r in runs)
    greedy = greedy_identity(online) if 0 in online["temperatures"] else ""
    lines.append(f"- offline and vLLM agree in all {len(runs)} runs (largest gap {worst:.3f} per position; tolerance: "
                 f"{agreement['greedy_tolerance']} at temperature 0, {agreement['z']:.2f} standard errors above it, "
                 f"{agreement['standard_errors']:g} family-wise over {agreement['sampled_comparisons']} positions)"
                 + greedy)
    return lines


def tool_call_table(online):
    """Per vLLM run whose drafts were split at the target's tool-call sections (evaluate_vllm with
    tokenize.tool_call_tokens): acceptance per position on the drafts that start in a tool call
    beside the rest, vLLM's counters split on its own text beside the offline estimate's split on
    the reference text; none where no run was split."""
    runs = [r for r in online["runs"] if "tool_call_spans" in r["offline"]]
    if not runs:
        return []
    lines = ["", "## Acceptance on tool-call spans (section begin to section end) and elsewhere", "",
             "| suite | temperature | concurrency | draft method, K | tool-call spans, vLLM | offline | drafts there "
             "(vLLM, offline) | elsewhere, vLLM | offline | drafts there (vLLM, offline) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        cells = []
        for name in ("tool_call_spans", "outside_tool_call_spans"):
            served, offline = r[name], r["offline"][name]
            cells += [_rates(served), _rates(offline), f"{served['num_drafts']:,.0f}, {offline['num_drafts']:,.0f}"]
        lines.append(f"| {r['suite']} | {r['temperature']:g} | {r['concurrency']} | {engine_label(r)} | "
                     + " | ".join(cells) + " |")
    lines += ["", "- a draft is the span's when its first token is: vLLM's counters are split on the text it served, "
                  "the offline estimate on the text it replays; at temperature 0 the two texts are the same"]
    return lines


def greedy_identity(online):
    """How speculation left greedy text, as the tail of the agreement line: unchanged, or changed
    only at near-ties of the target's logits (a fault fails evaluate_vllm)."""
    ties = [d for r in online["runs"] for d in r.get("divergences", [])]
    if not ties:
        return "; greedy text unchanged by speculation"
    runs = sum(bool(r.get("divergences")) for r in online["runs"])
    worst = max(ties, key=lambda d: abs(d["margin"]) / d["tolerance"] if d["tolerance"] else 0)
    cut = [r for r in online["runs"] if r.get("replayed_text_differs")]
    compared = sum(r["vllm_same_text"]["num_drafts"] for r in cut), sum(r["num_drafts"] for r in cut)
    return (f"; greedy text changed by speculation at {len(ties)} prompt(s) in {runs} run(s), each at a near-tie of "
            f"the target's logits within {online['engine_dtype']} rounding (closest to the limit: margin "
            f"{worst['margin']:.3g} of tolerance {worst['tolerance']:.3g})"
            + (f"; where a text left the replayed one, the {len(cut)} run(s) were compared on the drafts made before "
               f"({compared[0]:,} of {compared[1]:,})" if cut else ""))


def counts_in_words(counts):
    """{reason: n} as a person writes it: "3 too long, 1,024 duplicate" (reasons with none left
    out), or "none" (the summary's and the report's drops and rejections)."""
    return ", ".join(f"{n:,} {reason.replace('_', ' ')}" for reason, n in counts.items() if n) or "none"


def prompt_sources_line(counts_path):
    """What read_prompts took of each of data.sources (its counts file) and why not the rest."""
    counts = json.load(open(counts_path))
    parts = []
    for source in counts["sources"]:
        parts.append(f"{source['path']} ({source['shape']}): {source['prompts']} prompts from {source['used']} of "
                     f"{source['records']} records (dropped: {counts_in_words(source['dropped'])})")
    return f"- prompts: {counts['prompts']} from {len(parts)} sources (mix_seed {counts['mix_seed']}): " + "; ".join(parts)


def write_summary(tokenize_report, coverage, train_log, offline_metrics, vllm_metrics, out_path, prompt_sources=None):
    """A short markdown summary of one run (printed by `make demo`); prompt_sources: read_prompts'
    counts file, when the prompts were read from data.sources."""
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
        *([prompt_sources_line(prompt_sources)] if prompt_sources else []),
        f"- samples: {report['samples_in']} in, {report['samples_out']} tokenized "
        f"({report['truncated']} truncated, rejected: {counts_in_words(report['rejected'])}); "
        f"{report['tokens']} tokens, {report['generated_tokens']} generated"
        + (f"; {report['tool_call_turns']} call a tool, {report['tool_call_arguments_not_json']} with arguments that "
           "are not valid JSON" if "tool_call_turns" in report else ""),
        f"- draft vocab: {cov['draft_vocab_size']} of {cov['target_vocab_size']} ids, "
        f"covering {cov['coverage']:.1%} of generated tokens",
        "- training: final " + ", ".join(f"{k} {v}" for k, v in last.items()),
        f"- offline, on the held-out shards, K={offline['num_speculative_tokens']}: acceptance per position "
        f"{_rates(served)}, mean acceptance length {served['mean_acceptance_length']:.2f} ({served['num_drafts']} drafts); "
        f"ceiling at temperature 0 {_rates(served, 'ceiling_per_position')}"
        + (f"; on tool-call spans {_rates(served['tool_call_spans'])} ({served['tool_call_spans']['num_drafts']} "
           f"drafts), elsewhere {_rates(served['outside_tool_call_spans'])}" if "tool_call_spans" in served else ""),
        "- vLLM runs: suites " + ", ".join(f"{name} ({online['suites'][name]} prompts)"
                                            for name in dict.fromkeys(r["suite"] for r in online["runs"]))
        + f"; temperatures {', '.join(f'{t:g}' for t in online['temperatures'])}; draft methods "
        + ", ".join(online["draft_sample_methods"]) + " (probabilistic above temperature 0 only); K "
        + ", ".join(map(str, online["num_speculative_tokens"])) + "; concurrency "
        + ", ".join(map(str, online["concurrency"])) + latency_prompts(online)
        + f"; at most {online['max_tokens']} tokens each",
        "",
        *serving_table(online),
        *tool_call_table(online),
    ]
    text = "\n".join(lines) + "\n"
    with atomic_path(out_path) as tmp:
        tmp.write_text(text)
