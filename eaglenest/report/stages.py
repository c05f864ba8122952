"""The Stages table: what each stage did in this run, one row per stage: what it consumed and
produced, with counts from its artifacts and the wall time from its benchmark files."""

from itertools import product
from pathlib import Path

import pandas as pd

from eaglenest.evaluate.summary import counts_in_words
from eaglenest.plan.rates import benchmark_span, read_benchmark
from eaglenest.report.common import DASH, count, duration, percent, read_json, size, write_tables
from eaglenest.report.evaluate import agreement_sentence, suite_names
from eaglenest.report.train import read_train_log, ttt_steps
from eaglenest.workflow.config import HELDOUT_SUITE


def benchmarks(benchmark_dir, pattern):
    """(paths, records) of the benchmark files of a stage's jobs: benchmark_dir/<pattern> (a glob
    for a stage of several jobs; it may name a folder below, "vllm_speculative/K3.tsv")."""
    paths = [p for p in sorted(Path(benchmark_dir).glob(pattern)) if read_benchmark(p)]
    return paths, [read_benchmark(p) for p in paths]


def _times(paths, records):
    """(jobs, wall time, peak RSS) cells. Several jobs may run at once (generate_part's share one
    engine), so their wall time is the span from the first start to the last end, with the
    longest job beside it."""
    if not records:
        return DASH, DASH, DASH
    seconds = [r["s"] for r in records]
    rss = [r["max_rss_mib"] for r in records if r["max_rss_mib"] is not None]
    wall = (duration(seconds[0]) if len(records) == 1 else
            f"{duration(benchmark_span(paths))} (longest job {duration(max(seconds))})")
    return count(len(records)), wall, size(max(rss) * 2**20) if rss else DASH


def _row(stage, rules, consumed, produced, bench=((), ())):
    jobs, wall, rss = _times(*bench)
    return {"stage": stage, "rules": rules, "consumed": consumed, "produced": produced,
            "jobs benchmarked": jobs, "wall time": wall, "peak RSS": rss}


TARGET_SOURCES = {"demo": ("build_demo_target", "the demo corpus", "the demo target"),
                  "gguf": ("build_gguf_target", "target.gguf (a package's GGUF)", "the target"),
                  "path": (DASH, "target.path (built elsewhere)", "the target")}


def _target_row(a, target_source):
    manifest = a["manifest"]
    geometry = (f"{manifest['num_layers']} layers, hidden size {manifest['hidden_size']:,}, "
                f"{manifest['target_vocab_size']:,} ids")
    rule, consumed, what = TARGET_SOURCES[target_source]
    return _row("target", rule, consumed, f"{what}: {geometry}")


def _data_rows(a, bench, generated_here):
    report, cov = a["tokenize"], a["coverage"]
    generate = (_row("generate", "split_prompts, generate_part, generate_responses", "prompts",
                     f"{count(report['samples_in'])} response records", benchmarks(bench, "generate/part_*.tsv"))
                if generated_here else
                _row("generate", DASH, "skipped: data.raw_responses names responses made elsewhere",
                     f"{count(report['samples_in'])} response records"))
    return [
        generate,
        _row("tokenize", "tokenize", f"{count(report['samples_in'])} response records",
             f"{count(report['samples_out'])} samples, {count(report['tokens'])} tokens "
             f"({count(report['generated_tokens'])} generated); {count(report['truncated'])} truncated; "
             f"dropped: {counts_in_words(report['rejected'])}"),
        _row("draft vocabulary", "token_freq, vocab_map", f"{count(cov['generated_tokens'])} generated tokens "
             f"({count(cov['distinct_generated_tokens'])} distinct ids)",
             f"{count(cov['draft_vocab_size'])} of {count(cov['target_vocab_size'])} ids, covering "
             f"{percent(cov['coverage'])} of generated tokens"),
    ]


def _plan_row(a):
    plan = a["plan"]
    known = [s["estimate_s"] for s in plan.get("stages", []) if s.get("estimate_s") is not None]
    return _row("plan", "plan", f"{count(plan.get('tokens'))} tokens of {count(plan.get('samples'))} samples",
                f"{size(plan.get('hidden_states_bytes'))} of hidden states to write "
                f"({size(plan.get('free_disk_bytes'))} free), {size(plan.get('training_gpu_memory_bytes'))} "
                f"training memory per process, {duration(sum(known)) if known else DASH} of stage time foreseen")


def _states_row(a, bench, manifest_path):
    manifest = a["manifest"]
    folder = Path(manifest_path).parent
    stored = sum((folder / s["file"]).stat().st_size for s in manifest["shards"] if (folder / s["file"]).is_file())
    samples = sum(len(s["sample_ids"]) for s in manifest["shards"])
    tokens = sum(s["num_tokens"] for s in manifest["shards"])
    return _row("hidden states", "shard_samples, hidden_states, hidden_states_manifest",
                f"{count(samples)} samples, the target ({manifest['num_layers']} layers)",
                f"{count(len(manifest['shards']))} shards, {count(tokens)} tokens, {size(stored)} "
                f"({manifest['dtype']}, aux layers {manifest['aux_layer_ids']})",
                benchmarks(bench, "hidden_states/shard_*.tsv"))


def _train_row(a, bench):
    log = a["train_log"]
    last = log.iloc[-1]
    accs = " / ".join(f"{last[f'acc_{k}']:.2f}" for k in ttt_steps(log, "acc"))
    return _row("train", "train_drafter, export_eagle, check_drafter", "the hidden-state shards, d2t / t2d",
                f"a drafter after {count(last['step'])} steps over {int(last['epoch']) + 1} epochs "
                f"({count(last['tokens'])} supervised tokens); final weighted loss {last['loss']:.3f}, accuracy per "
                f"TTT step {accs}; pre-flight check " + ("passed" if a["check"].get("ok") else "failed"),
                benchmarks(bench, "train_drafter.tsv"))


def _span(values, fmt):
    """The range of `values` in `fmt`: one figure when they are all the same."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo} to {hi}"


def _vllm_rows(online, layers, bench):
    """The rows of eval_prompts, vllm_baseline, each draft method and K's vllm_speculative job and
    agreement_states."""
    runs, suites = online["runs"], suite_names(online)
    grid = (f"{len(suites)} suite(s) × {len(online['temperatures'])} temperature(s) × "
            f"{len(online['concurrency'])} concurrency level(s)")
    plain = {(r["suite"], r["temperature"], r["concurrency"]): r["tokens_per_s_without_speculation"] for r in runs}
    prompts = ", ".join(f"{s} {count(online['suites'][s])}" for s in suites)
    rows = [
        _row("evaluation prompts", "eval_prompts", "the held-out split" + "".join(
            f", eval.suites' {s}" for s in suites if s != HELDOUT_SUITE), f"prompts per suite: {prompts}"),
        _row("vLLM baseline", "vllm_baseline", f"{count(sum(online['suites'].values()))} prompts, the target",
             f"{len(plain)} runs without the drafter ({grid}) and their text: "
             f"{_span(plain.values(), '{:,.0f}')} tokens/s", benchmarks(bench, "vllm_baseline.tsv")),
    ]
    for method, K in product(online["draft_sample_methods"], online["num_speculative_tokens"]):
        engine = [r for r in runs if (r["draft_sample_method"], r["num_speculative_tokens"]) == (method, K)]
        greedy = [r for r in engine if "greedy_text_unchanged" in r]  # temperature 0: the baseline's text is greedy
        unchanged = (f"; greedy text unchanged in {sum(r['greedy_text_unchanged'] for r in greedy)} of {len(greedy)} "
                     "runs at temperature 0") if greedy else ""
        rows.append(_row(
            f"vLLM with the drafter, {method}, K = {K}", "vllm_speculative", "the prompts, the target, the drafter, "
            "the baseline's greedy text", f"{len(engine)} runs, {count(sum(r['generated_tokens'] for r in engine))} "
            f"tokens: mean acceptance length {_span([r['mean_acceptance_length'] for r in engine], '{:.2f}')}, "
            f"speed-up {_span([r['speedup'] for r in engine], '{:.2f}x')}{unchanged}",
            benchmarks(bench, f"vllm_speculative/{method}/K{K}.tsv")))
    texts = ", ".join(f"{t['suite']} at temperature {t['temperature']:g} ({count(t['samples'])})"
                      for t in layers["texts"])
    rows.append(_row("agreement states", "agreement_states", f"the baseline's text: {texts}", f"the target's states "
                     f"of {count(layers['num_samples'])} samples, {count(layers['num_tokens'])} tokens "
                     f"({layers['backend']} backend)", benchmarks(bench, "agreement_states.tsv")))
    return rows


def _evaluate_rows(a, bench):
    offline, online = a["offline"], a["vllm"]
    served = " / ".join(f"{r:.2f}" for r in offline["served"]["acceptance_rate_per_position"])
    paying = [r for r in online["recommended"] if r["speculation_pays"]]
    return [
        _row("offline evaluation", "evaluate_offline", f"{count(offline['heldout_samples'])} held-out samples "
             f"({count(offline['heldout_tokens'])} tokens)", f"acceptance {served} at vLLM's anchors (K = "
             f"{offline['num_speculative_tokens']}), mean acceptance length "
             f"{offline['served']['mean_acceptance_length']:.2f}", benchmarks(bench, "evaluate_offline.tsv")),
        *_vllm_rows(online, a["agreement"], bench),
        _row("vLLM evaluation", "evaluate_vllm", "vLLM's counters, the agreement states",
             agreement_sentence(online) + f" Speculation pays in {len(paying)} of {len(online['recommended'])} "
             "(suite, temperature, concurrency) settings at their best draft method and K.",
             benchmarks(bench, "evaluate_vllm.tsv")),
    ]


def stages_table(paths, benchmark_dir, *, generated_here, target_source):
    """DataFrame, one row per stage of this run, from the artifacts in `paths` (keys: plan, tokenize,
    coverage, manifest, train_log, check, offline, vllm, agreement: the agreement states' folder).
    generated_here: the target answered the prompts in this workflow (no data.raw_responses);
    target_source: where the target came from, "demo" or "gguf" (built here) or "path"."""
    a = {key: read_json(paths[key]) for key in ("plan", "tokenize", "coverage", "manifest", "check", "offline", "vllm")}
    a["train_log"] = read_train_log(paths["train_log"])
    a["agreement"] = read_json(Path(paths["agreement"]) / "layers.json")
    rows = [_target_row(a, target_source), *_data_rows(a, benchmark_dir, generated_here), _plan_row(a),
            _states_row(a, benchmark_dir, paths["manifest"]),
            _train_row(a, benchmark_dir), *_evaluate_rows(a, benchmark_dir)]
    return pd.DataFrame(rows)


def write_stages_table(paths, benchmark_dir, table_path, *, generated_here, target_source):
    """What each stage did in this run, as an HTML table (see stages_table)."""
    note = ("One row per stage of this run: what it read, what it wrote, and, for the stages Snakemake "
            "benchmarks (the GPU stages), the wall time and peak memory of their jobs. The other stages "
            "take seconds; their run times are under Statistics.")
    write_tables(table_path, "What each stage did in this run",
                 [(None, stages_table(paths, benchmark_dir, generated_here=generated_here,
                                          target_source=target_source))], note,
                 numeric={"jobs benchmarked", "wall time", "peak RSS"})
