"""Proof that vLLM runs the drafter we trained, at every temperature: each run's acceptance
counters against the offline evaluator's on the baseline's text (rule evaluate_vllm).

The offline side reads the target's hidden states of the reference texts from the agreement
states (eaglenest.evaluate.agreement_states: taken by the hidden_states stage's backend, never by a
second copy of the target; of the target only its embedding, final norm and lm_head are read
here), builds the drafter from the trained weights with the
settings training used, the manifest's aux layers and the vocab stage's d2t, and replays vLLM's
chain drafting on the text (eaglenest.evaluate.expected). At temperature 0 the two must agree
within eval.agreement_tolerance per position, as replaying greedy text is exact; above 0 within
the standard errors of eval.agreement_standard_errors (family-wise over every sampled run). When
they do not, vLLM read the drafter differently from how it was trained (the silent mismatches:
aux layer ids in another convention, a norm flag defaulted the other way, a d2t in another
form), and the run fails naming the reading that reproduces vLLM's numbers.

Each run is replayed by its own draft method (vLLM's draft_sample_method: greedy drafts the
argmax, probabilistic samples from the drafter's distribution; eaglenest.evaluate.expected), and
beside it goes the ceiling of that method on the same text (expected.ceiling_outcomes, named by
expected.CEILINGS) and the run's share of it. Greedy's is an oracle drafting the target's argmax:
1 at temperature 0, and above 0 the most greedy drafting allows (max p_T). Probabilistic's is an
oracle drafting from p_T restricted to the draft vocab: above greedy's wherever p_T is spread, as
p_T's mass on the draft vocab bounds sum min(p_T, q). A share near 1 says the drafter has learned
what its method can use, a low one that it has not.

Where the target's tool-call tokens are named (config tokenize.tool_call_tokens), each run's
offline estimate also holds its split between the drafts that start in a tool-call section and
the others (offline_estimates, acceptance.drafts_in_span): at temperature 0 the replay of greedy
text is exact, so that split is vLLM's own, and its whole agrees with vLLM's counters.
"""

import json
import logging
import math
from pathlib import Path

import torch

from eaglenest.data.vocab import load_vocab
from eaglenest.drafter.load import as_served, load_drafter, load_drafter_copy
from eaglenest.drafter.model import DrafterConfig
from eaglenest.data.tokenizer import tool_call_span
from eaglenest.evaluate.acceptance import acceptance_fields, drafts_in_span, share_of_ceiling
from eaglenest.evaluate.agreement_states import AgreementStates, layer_misreadings, text_key
from eaglenest.evaluate.expected import (CEILING_DESCRIPTIONS, CEILINGS, ceiling_outcomes, chain_outcomes, estimate,
                                         family_z, ratio_standard_error, rounding_decided, sample_counts,
                                         sample_seed)
from eaglenest.evaluate.greedy_identity import judge_divergences
from eaglenest.evaluate.online import recommend
from eaglenest.states.manifest import read_manifest
from eaglenest.states.shards import dequantize_states
from eaglenest.drafter.target_head import TargetHead
from eaglenest.workflow.atomic import write_json
from eaglenest.workflow.device import torch_device
from eaglenest.workflow.serving import DRAFT_SAMPLE_METHODS
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.progress import ProgressLines
from eaglenest.workflow.tracking import log_acceptance, open_trackers

log = logging.getLogger(__name__)

SPANS = ("tool_call_spans", "outside_tool_call_spans")  # how offline_estimates splits its drafts


def online_acceptance(counters):
    """vLLM's spec-decode counters -> the fields of eaglenest.evaluate.acceptance."""
    return acceptance_fields(
        int(counters["num_drafts"]),
        int(counters["num_draft_tokens"]),
        int(counters["num_accepted_tokens"]),
        [int(n) for n in counters["num_accepted_tokens_per_position"]],
    )


def trained_drafter(drafter_dir, trained_config, d2t, t2d, embed_tokens):
    """The drafter as trained: weights from `drafter_dir`, everything else from its sources."""
    drafter = load_drafter(drafter_dir, embed_tokens, config=trained_config)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    return drafter


@torch.no_grad()
def offline_estimates(states, indices, variants, Ks, *, temperature, max_tokens, head, device, method="greedy",
                      ceiling=False, span=None, served_caps=None, exact=None):
    """The offline estimate (eaglenest.evaluate.expected.estimate) at each K of `Ks` of each
    (drafter, aux layer ids) of `variants` drafting by `method` (vLLM's draft_sample_method), on
    the samples `indices` of `states` (an AgreementStates: the baseline's text at `temperature`, of
    which the served runs generated at most `max_tokens` tokens), in one pass over them -> [{K:
    estimate}] per variant. `ceiling`: then also, last, the oracle that bounds `method` on this
    text (expected.ceiling_outcomes), from the same read of each sample. `span`: the ids (begin,
    end) of the target's tool-call section: each estimate then also holds "tool_call_spans" and
    "outside_tool_call_spans", the same estimate over the drafts that start inside a section and
    over the others (acceptance.drafts_in_span), which split its drafts. `served_caps`: {sample
    index: served tokens at most} (common_text_caps: where a run's text left this one).
    `exact`: at temperature 0, the first variant's drafter computed in float32 where the variants
    are in a coarser engine dtype: its estimates then also hold "rounding_decided_per_position"
    (rounding_decided)."""
    columns = [states.columns(layer_ids) for _, layer_ids in variants]
    counts = [{K: [] for K in Ks} for _ in range(len(variants) + ceiling)]
    parts = [[{K: [] for K in Ks} for _ in counts] for _ in range(2 if span else 0)]  # in spans, outside
    decided = {K: [] for K in Ks}  # per sample, rounding_decided's counts
    ticker = ProgressLines(f"agreement check, T={temperature:g}, {method}", len(indices), "samples", logger=log)
    for i in indices:
        stored = states[i]
        sample = dequantize_states({key: value.to(device) for key, value in stored.items() if key != "id"},
                                   torch.float32)  # FP8 states: dequantized on the device
        served = min(int(sample["loss_mask"].sum()), max_tokens, (served_caps or {}).get(i, max_tokens))
        text = {key: sample[key] for key in ("input_ids", "loss_mask", "final_hidden_states")}
        seed = sample_seed(stored["id"])  # the sample's draws, the same for every variant (they are compared)
        outcomes = [chain_outcomes(drafter, text | {"aux_hidden_states": sample["aux_hidden_states"][:, cols]},
                                   served, max(Ks), head=head, temperature=temperature, method=method, seed=seed)
                    for (drafter, _), cols in zip(variants, columns)]
        if exact is not None and temperature == 0:
            _, exact_matched, _ = chain_outcomes(exact, text | {"aux_hidden_states": sample["aux_hidden_states"][:, columns[0]]},
                                                 served, max(Ks))
            for K in Ks:
                decided[K].append(rounding_decided(outcomes[0], exact_matched, K))
        if ceiling:
            targets = variants[0][0].draft_to_target(torch.arange(len(variants[0][0].d2t), device=device))
            outcomes.append(ceiling_outcomes(text, served, max(Ks), head=head, temperature=temperature, method=method,
                                             targets=targets, seed=seed))
        inside = drafts_in_span(sample["input_ids"], *span) if span else None
        for v, (anchors, matched, probs) in enumerate(outcomes):
            for K in Ks:
                counts[v][K].append(sample_counts(anchors, matched, probs, K))
                for part, keep in zip(parts, (inside, ~inside) if span else ()):
                    part[v][K].append(sample_counts(anchors, matched, probs, K, keep))
        ticker.advance()
    estimates = [{K: estimate(per_k[K], K) for K in Ks} for per_k in counts]
    for K in Ks:
        if decided[K]:
            drafts = max(sum(n for n, _, _ in counts[0][K]), 1)
            estimates[0][K]["rounding_decided_per_position"] = [sum(d[k] for d in decided[K]) / drafts for k in range(K)]
    for name, part in zip(SPANS, parts):
        for v, per_k in enumerate(part):
            for K in Ks:
                estimates[v][K][name] = estimate(per_k[K], K)
    return estimates


def misreadings(drafter, aux_layer_ids, num_layers):
    """The ways vLLM could read our drafter differently, as (description, drafter, aux ids): a norm
    flag that needs no weights of its own read the other way (with norm_output on, the next step's
    input is normed already, and norm_before_residual changes little), the aux layers shifted, d2t
    read as absolute ids; for an mla drafter with YaRN, its rope read as plain (no YaRN frequencies
    nor softmax mscale: what a rope_parameters key vLLM does not find would give)."""
    out = []
    for name in ("norm_before_residual", "norm_output"):
        flag = getattr(drafter.config, name)
        out.append((f"{name} read as {not flag} (trained with {flag})", load_drafter_copy(drafter, **{name: not flag}),
                    aux_layer_ids))
    if drafter.config.layer == "mla" and drafter.config.rope_scaling:
        out.append((f"rope read as plain RoPE (trained with {drafter.config.rope_scaling['rope_type']})",
                     load_drafter_copy(drafter, rope_scaling=None), aux_layer_ids))
    out += [(description, drafter, ids) for description, ids in layer_misreadings(aux_layer_ids, num_layers)]
    absolute = load_drafter_copy(drafter)
    absolute.d2t.copy_(drafter.draft_to_target(torch.arange(len(drafter.d2t), device=drafter.d2t.device)))
    out.append(("d2t read as absolute target ids instead of offsets", absolute, aux_layer_ids))
    return out


def compare(online, offline, tolerance):
    """vLLM's acceptance against the offline estimate, position by position: {"max_disagreement",
    "tolerance_per_position", "agrees"}."""
    gaps = [abs(a - b) for a, b in zip(online["acceptance_rate_per_position"], offline["acceptance_rate_per_position"])]
    return {"max_disagreement": max(gaps), "tolerance_per_position": tolerance,
            "agrees": all(gap <= t for gap, t in zip(gaps, tolerance))}


def tolerance(offline, temperature, online, *, agreement_tolerance, z, per_request=None):
    """Per position: at temperature 0 eval.agreement_tolerance (replaying greedy text is exact but
    for float rounding), plus the share of drafts whose outcome the engine dtype's rounding decides
    where the replay measured it ("rounding_decided_per_position": a bfloat16 engine), else `z` standard errors of the gap (eaglenest.evaluate.expected). vLLM's
    share of it is its own sample's by-prompt spread where the run kept each request's counts
    (`per_request`: acceptance.request_counts), never below the replay's indicator's, which stands
    for it (a sample of a few drafts may accept none, and spread by nothing); each at least the
    binomial one of vLLM's own rate over its drafts: where the replay accepts
    next to nothing its standard error is next to 0, while vLLM's counter, a sample, may still hold
    a few (a weak drafter at a deep position: 2 of 239 against an expected 0.1). vLLM's own spread
    counts where answers fall into loops: a few looping samples carry most of a deep position's
    accepts, so one sample's spread says little of another's (the Kimi-shaped demo's target)."""
    if temperature == 0:
        decided = offline.get("rounding_decided_per_position", [0.0] * len(offline["acceptance_rate_per_position"]))
        return [agreement_tolerance + share for share in decided]
    if per_request:
        own = [ratio_standard_error([a[k] for a in per_request["accepted_per_position"]], per_request["drafts"])
               for k in range(len(offline["acceptance_rate_per_position"]))]
        errors = [math.hypot(max(se, indicator), expected)  # never below the indicator's: a few drafts may all miss
                  for se, indicator, expected in zip(own, offline["indicator_standard_error_per_position"],
                                                     offline["expected_standard_error_per_position"])]
    else:
        errors = offline["standard_error_per_position"]
    drafts = max(online["num_drafts"], 1)
    return [z * max(se, math.sqrt(rate * (1 - rate) / drafts))
            for se, rate in zip(errors, online["acceptance_rate_per_position"])]


def common_text_caps(states, run):
    """{sample index: served tokens at most} for a temperature-0 run whose text left the replayed
    one ("replayed_text_differs": prompt id -> first differing generated token): the text both
    share, on which sample_counts keeps the drafts whose guesses all fall (vLLM's side:
    acceptance.common_text_counters)."""
    index = {sample_id: i for i, (_, _, _, sample_id) in enumerate(states.samples.index)}
    return {index[text_key(run["suite"], 0.0, prompt_id)]: first for prompt_id, first in run["replayed_text_differs"].items()}


def _rates(fields):
    return " / ".join(f"{a:.2f}" for a in fields["acceptance_rate_per_position"])


def disagreement(failing, count, cause):
    """The InputError of runs whose vLLM acceptance is off the offline estimate."""
    first = failing[0]
    where = (f"{first['suite']} T={first['temperature']:g} c={first['concurrency']} {first['draft_sample_method']} "
             f"K={first['num_speculative_tokens']}")
    return InputError(
        f"vLLM does not run the drafter as trained: {len(failing)} of {count} runs disagree with the offline "
        f"estimate; first {where}: acceptance per position in vLLM {_rates(first['vllm_same_text'])}, offline on the same text "
        f"{_rates(first['offline'])} (tolerance " + " / ".join(f"{t:.3f}" for t in first["tolerance_per_position"])
        + f"); {cause}")


def diagnose(states, indices, run, drafter, aux_layer_ids, num_layers, *, max_tokens, head, device, served_caps=None):
    """The misreadings (misreadings()) whose offline estimate agrees with `run`'s vLLM counters on
    the text compared (`served_caps` as offline_estimates') within the run's own tolerance, as a sentence."""
    K, temperature = run["num_speculative_tokens"], run["temperature"]
    variants = misreadings(drafter, aux_layer_ids, num_layers)
    estimates = offline_estimates(states, indices, [(variant, ids) for _, variant, ids in variants], [K],
                                  temperature=temperature, max_tokens=max_tokens, head=head, device=device,
                                  method=run["draft_sample_method"], served_caps=served_caps)
    found = []
    for (description, _, _), by_k in zip(variants, estimates):
        verdict = compare(run["vllm_same_text"], by_k[K], run["tolerance_per_position"])
        log.info("misreading %s: offline %s (largest gap to vLLM %.3f)", description,
                 by_k[K]["acceptance_rate_per_position"], verdict["max_disagreement"])
        if verdict["agrees"]:
            found.append(description)
    if not found:
        return "no known misreading reproduces it (check the target, dtype and vLLM version)"
    if temperature == 0:
        return "it matches the offline estimate when " + "; or when ".join(found)
    return "within the standard errors it is consistent with " + "; or with ".join(found)


def speculative_run(spec, run, plain, offline, ceiling, tolerance_per_position):
    """One vllm_metrics.json run: the (method, K) engine's run `run` (with vLLM's counters), the
    baseline's run `plain` at the same (suite, temperature, concurrency), the offline estimate on
    the same text and the method's ceiling there (offline_estimates' oracle at the same K). The
    comparison holds vLLM's drafts whose guesses all fall on the text it returned and, at
    temperature 0, on the text the offline side replays ("vllm_same_text": vllm_speculative's
    common_text_counters), as the offline side counts its own (expected.sample_counts). With vLLM's
    counters split at tool-call spans (acceptance.span_counters, on the same steps) it holds their
    acceptance fields too, beside the offline estimate's split of its own drafts."""
    online = online_acceptance(run["counters"])
    same_text = online_acceptance(run["common_text_counters"])
    ceiling_rates = ceiling["acceptance_rate_per_position"]
    keep = {key: run[key] for key in ("greedy_text_unchanged", "divergent_share", "divergences", "replayed_text_differs")
            if key in run}
    keep |= {name: online_acceptance(counters) for name, counters in run.get("span_counters", {}).items()}
    return {"suite": run["suite"], "temperature": run["temperature"],
            "draft_sample_method": spec["draft_sample_method"], "num_speculative_tokens": spec["num_speculative_tokens"],
            "concurrency": run["concurrency"], "prompts": run["prompts"], "generated_tokens": run["generated_tokens"],
            "counters": run["counters"], **online,
            "tokens_per_s_without_speculation": plain["tokens_per_s"], "tokens_per_s_with_speculation": run["tokens_per_s"],
            "speedup": run["tokens_per_s"] / plain["tokens_per_s"], **keep,
            "ceiling": CEILINGS[spec["draft_sample_method"]], "ceiling_per_position": ceiling_rates,
            "share_of_ceiling_per_position": share_of_ceiling(same_text["acceptance_rate_per_position"], ceiling_rates),
            "vllm_same_text": same_text, "offline": offline, **compare(same_text, offline, tolerance_per_position)}


def estimates_by_run(states, texts, speculative, drafter, aux_layer_ids, Ks, *, max_tokens, head, device, span=None,
                     exact=None):
    """offline_estimates() and the ceilings for every run of the engines' files `speculative`, by
    (suite, temperature, prompts, method): a run of n prompts ran its suite's first n, so each
    (text, size, method) is estimated once, at every K. `exact`: as offline_estimates'."""
    offline, ceiling = {}, {}
    for suite, t, indices in texts:
        for method in dict.fromkeys(spec["draft_sample_method"] for spec in speculative):
            sizes = {run["prompts"] for spec in speculative for run in spec["runs"]
                     if (run["suite"], run["temperature"], spec["draft_sample_method"]) == (suite, t, method)}
            for n in sorted(sizes):
                offline[suite, t, n, method], ceiling[suite, t, n, method] = offline_estimates(
                    states, indices[:n], [(drafter, aux_layer_ids)], Ks, temperature=t, max_tokens=max_tokens,
                    head=head, device=device, method=method, ceiling=True, span=span, exact=exact)
    return offline, ceiling


def compared_runs(speculative, offline, ceiling, plain, states, texts, drafter, aux_layer_ids, *, z,
                  agreement_tolerance, max_tokens, head, device, span, exact=None):
    """Each run of the engines' files `speculative` against its offline estimate (speculative_run),
    with its tolerance -> (runs, cuts: each run's common_text_caps, None where compared on the whole
    text). offline, ceiling: estimates_by_run's; plain: the baseline's runs by (suite, temperature,
    concurrency); exact: as offline_estimates'."""
    runs, cuts = [], []  # cuts: each run's common_text_caps (None: compared on the whole text)
    for spec in speculative:
        for run in spec["runs"]:
            key, K, method = (run["suite"], run["temperature"]), spec["num_speculative_tokens"], spec["draft_sample_method"]
            on_its_prompts = key + (run["prompts"], method)
            estimate_k, ceiling_k = offline[on_its_prompts][K], ceiling[on_its_prompts][K]
            cuts.append(common_text_caps(states, run) if run.get("replayed_text_differs") else None)
            if cuts[-1]:  # temperature 0 on an engine that is not bit-exact: the text both share
                indices = next(i for suite, t, i in texts if (suite, t) == key)[: run["prompts"]]
                estimate_k = offline_estimates(states, indices, [(drafter, aux_layer_ids)], [K], temperature=0.0,
                                               max_tokens=max_tokens, head=head, device=device, method=method,
                                               span=span, served_caps=cuts[-1], exact=exact)[0][K]
            limits = tolerance(estimate_k, run["temperature"], online_acceptance(run["common_text_counters"]),
                               agreement_tolerance=agreement_tolerance, z=z, per_request=run.get("per_request"))
            runs.append(speculative_run(spec, run, plain[key + (run["concurrency"],)], estimate_k, ceiling_k, limits))
            same = runs[-1]["vllm_same_text"]
            log.info("%s T=%g c=%d %s K=%d: vLLM %s, offline %s (on %d of vLLM's %d drafts: %s), tolerance %s: %s; "
                     "ceiling (%s) %s", *key, run["concurrency"], method, K, _rates(same), _rates(estimate_k),
                     same["num_drafts"], runs[-1]["num_drafts"],
                     "their guesses on the text both share" if cuts[-1] else "their guesses on its text",
                     " / ".join(f"{t:.3f}" for t in limits), "agree" if runs[-1]["agrees"] else "DISAGREE",
                     CEILINGS[method], _rates(ceiling_k))
    return runs, cuts


def evaluate_vllm(baseline_path, outputs_path, speculative_paths, states_dir, target_dir, drafter_dir,
                  trained_config_path, manifest_path, d2t_path, t2d_path, metrics_path, *, agreement_tolerance,
                  agreement_standard_errors, device=None, tracking=None, trust_remote_code=False, tool_call_tokens=None):
    """The evaluate_vllm stage: vllm_metrics.json (docs/CONTRACTS.md) from the baseline's runs and
    continuations, each (draft method, K) engine's runs (`speculative_paths`) and the target's
    states of the reference texts (`states_dir`, rule agreement_states), with the drafter built as
    trained on `device`. Fails where speculation changed greedy text beyond a near-tie (eaglenest.evaluate.
    greedy_identity), and, naming the misreadings that reproduce vLLM's numbers, when any run's acceptance is
    off its method's offline estimate by its tolerance. Each run also gets its method's ceiling on its text
    (offline_estimates' oracle) and its share of it. Of the target only the embedding, final norm and lm_head
    are read. `tracking`: the config's tracking section (None: none), whose trackers get each run's acceptance
    per position, as run evaluate_vllm (TensorBoard: tensorboard/evaluate_vllm); tool_call_tokens: see above."""
    device = torch_device(device)
    baseline = json.loads(Path(baseline_path).read_text())
    speculative = sorted((json.loads(Path(p).read_text()) for p in speculative_paths),
                         key=lambda spec: (DRAFT_SAMPLE_METHODS.index(spec["draft_sample_method"]),
                                           spec["num_speculative_tokens"]))
    Ks = sorted({spec["num_speculative_tokens"] for spec in speculative})
    states = AgreementStates(states_dir)
    states.check_text(outputs_path)
    manifest = read_manifest(manifest_path)
    aux_layer_ids = list(manifest["aux_layer_ids"])
    if states.info["aux_layer_ids"] != aux_layer_ids:
        raise InputError(f"{states_dir}: states for aux layers {states.info['aux_layer_ids']}, "
                         f"the manifest's are {aux_layer_ids}")
    texts = states.texts()
    head = TargetHead(target_dir, device)  # its argmax: the ceiling; above temperature 0 its probabilities
    trained = DrafterConfig(**json.loads(Path(trained_config_path).read_text()))
    trained_weights = trained_drafter(drafter_dir, trained, *load_vocab(d2t_path, t2d_path), head.embed_tokens).to(device)
    engine_dtype = getattr(torch, speculative[0]["engine_dtype"])
    drafter = as_served(trained_weights, engine_dtype)  # replayed as vLLM computes it
    exact = None if drafter is trained_weights else trained_weights  # a coarser dtype: what its rounding decides
    log.info("offline side: %d samples of %s (%s backend, %s, layers %s); no target model loaded", len(states),
             states_dir, states.info["backend"], states.info["dtype"], states.info["layer_ids"])
    judge_divergences(speculative, states, head, outputs_path)  # fails on a fault
    max_tokens = baseline["max_tokens"]
    span = tool_call_span(target_dir, trust_remote_code=trust_remote_code, tool_call_tokens=tool_call_tokens)
    offline, ceiling = estimates_by_run(states, texts, speculative, drafter, aux_layer_ids, Ks, max_tokens=max_tokens,
                                        head=head, device=device, span=span, exact=exact)
    plain = {(r["suite"], r["temperature"], r["concurrency"]): r for r in baseline["runs"]}
    sampled = sum(spec["num_speculative_tokens"] * sum(r["temperature"] > 0 for r in spec["runs"])
                  for spec in speculative)  # positions compared at temperature > 0
    z = family_z(agreement_standard_errors, sampled)
    runs, cuts = compared_runs(speculative, offline, ceiling, plain, states, texts, drafter, aux_layer_ids, z=z,
                               agreement_tolerance=agreement_tolerance, max_tokens=max_tokens, head=head,
                               device=device, span=span, exact=exact)
    if failing := [r for r in runs if not r["agrees"]]:
        first = failing[0]
        indices = next(i for suite, t, i in texts if (suite, t) == (first["suite"], first["temperature"]))
        indices = indices[: first["prompts"]]
        raise disagreement(failing, len(runs), diagnose(states, indices, first, drafter, aux_layer_ids,
                                                        manifest["num_layers"], max_tokens=max_tokens, head=head,
                                                        device=device, served_caps=cuts[runs.index(first)]))
    methods = list(dict.fromkeys(spec["draft_sample_method"] for spec in speculative))
    metrics = {
        "vllm_version": speculative[0]["vllm_version"],
        "max_tokens": max_tokens,
        "suites": {suite: max(r["prompts"] for (s, _, _), r in plain.items() if s == suite) for suite, _, _ in plain},
        "temperatures": sorted({t for _, t, _ in plain}),
        "draft_sample_methods": methods,
        "num_speculative_tokens": Ks,
        "concurrency": sorted({c for _, _, c in plain}),
        "ceilings": {method: CEILING_DESCRIPTIONS[method] for method in methods},
        "engine_dtype": speculative[0]["engine_dtype"],
        "agreement": {"greedy_tolerance": agreement_tolerance, "standard_errors": agreement_standard_errors,
                      "sampled_comparisons": sampled, "z": z},
        "runs": runs,
        "recommended": recommend(runs),
    }
    write_json(metrics_path, metrics)
    with open_trackers(tracking, Path(metrics_path).parent, "evaluate_vllm") as trackers:
        log_acceptance(trackers, {run_tag(run): run for run in runs})
    return metrics


def run_tag(run):
    """A vllm_metrics.json run's name for the trackers: vllm/{suite}/T{temperature}/{method}/K{K}/c{concurrency}."""
    return (f"vllm/{run['suite']}/T{run['temperature']:g}/{run['draft_sample_method']}/K{run['num_speculative_tokens']}"
            f"/c{run['concurrency']}")
