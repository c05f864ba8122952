"""Greedy identity judged token by token: where speculation changed the greedy text at temperature 0,
did the target see a near-tie there (numerics) or a clear preference (a fault)?

vllm_speculative records, per prompt whose greedy text speculation changed, the first generated
token `at` where it differs from the baseline's at the same concurrency and the two tokens there
(eaglenest.evaluate.online.greedy_divergences). Generated token `at` is predicted from the state at
position len(prompt) + at - 1 of the baseline's text: the agreement states hold it (the target's
final hidden state by the hidden_states backend, rule agreement_states), and the target's head
gives the two tokens' logits there (TargetHead.logits, in float64).

Which gap is a tie. The engine computes logits in its dtype (vLLM's model_config.dtype: bfloat16
for Kimi, float32 in the CPU demo). A value rounded to that dtype carries a relative error of at
most its unit roundoff u = eps / 2 (torch.finfo(dtype).eps: 2^-7 for bfloat16, 2^-23 for
float32), so two logits l_a, l_b whose gap is within u (|l_a| + |l_b|) <= eps max(|l_a|, |l_b|)
can swap order between two computations that differ only in rounding, as plain decoding and
speculative verification (other batch shapes, other summation orders) do. A logit is a dot
product whose terms are each rounded, so the tolerance is eps x the two dot products' mean
absolute sum sum_i |w_i x_i| (judge): at least one unit in the last place of the larger logit
(bfloat16, logits near 20: 0.16; float32: 2.4e-6), more where a logit is a small sum of large
terms. The states the gap is measured
from were themselves stored in hidden_states.dtype, so eps is the coarser of the engine's and the
states' dtype. A gap within it is numerics and is reported; a larger one means the speculative
run emitted a token the target clearly did not choose, a fault in drafting or verification, and
the run fails. No per-model setting: the same rule holds a bit-exact float32 engine to (nearly)
exact identity and lets bfloat16 text drift where the target was undecided.
"""

import logging

import torch

from eaglenest.evaluate.agreement_states import text_key
from eaglenest.states.shards import dequantize_states
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import read_objects

log = logging.getLogger(__name__)


def logit_tolerance(magnitude, dtype, states_dtype=torch.float32):
    """The largest gap between two logits of about `magnitude` that rounding to `dtype` (the
    engine's; the states' `states_dtype` when coarser) can swap: eps x magnitude (module docstring)."""
    eps = max(torch.finfo(getattr(torch, str(dtype).removeprefix("torch."))).eps,
              torch.finfo(getattr(torch, str(states_dtype).removeprefix("torch."))).eps)
    return eps * magnitude


def judge(baseline_logit, speculative_logit, dtype, states_dtype=torch.float32, magnitude=None):
    """A divergence's verdict from the target's logits of the baseline's token and the speculative
    run's at the divergent position: {"margin": how far the baseline's token leads, "tolerance",
    "near_tie": the baseline's token leads by no more than the tolerance}. One-sided: where the
    target's logits, computed again from the agreement states, prefer the speculative run's token,
    the two computations of the target disagree (prefill against decode, each rounded at every
    layer), and speculation emitted what the target chose there: numerics, never a drafting fault
    (measured on the Kimi-shaped demo in bfloat16: a margin of -0.085). `magnitude`: what rounding
    can move the gap by, in units of eps: the two dot products' absolute sums sum_i |w_i x_i|
    (TargetHead.logits; each term of a dot product is rounded to the dtype, so its sum can move
    by eps/2 of them, the other logit's likewise), by default the larger logit's magnitude. The
    absolute sums, not the logits, bound it: a logit that is a small sum of large terms (on the
    Kimi-shaped demo's bfloat16 divergences, margins of 0.062 against 0.052 of eps x |logit|)
    carries their rounding."""
    margin = float(baseline_logit) - float(speculative_logit)
    if magnitude is None:
        magnitude = max(abs(float(baseline_logit)), abs(float(speculative_logit)))
    tolerance = logit_tolerance(float(magnitude), dtype, states_dtype)
    return {"margin": margin, "tolerance": tolerance, "near_tie": margin <= tolerance}


def baseline_texts(outputs_path):
    """{(suite, concurrency, prompt id): (prompt, greedy continuation)} of vllm_baseline's
    temperature-0 outputs: the text each divergence is judged on."""
    return {(o["suite"], o["concurrency"], o["id"]): (o["prompt_token_ids"], o["token_ids"])
            for o in read_objects(outputs_path) if o["temperature"] == 0}


def final_state(states, by_id, suite, concurrency, prompt_id, prefix):
    """The target's final hidden state after `prefix` (a prompt and the first tokens of its
    baseline continuation) from the agreement states: the largest concurrency's text, or this
    concurrency's where its text differs from that one (agreement_states.reference_samples)."""
    key = text_key(suite, 0.0, prompt_id)
    for sample_id in (key, f"{key}/c{concurrency}"):
        if sample_id in by_id:
            sample = states[by_id[sample_id]]
            if sample["input_ids"][: len(prefix)].tolist() == prefix:
                return dequantize_states(sample, torch.float32)["final_hidden_states"][len(prefix) - 1]  # FP8: scaled
    raise InputError(f"{states.dir}: no state of {suite} prompt {prompt_id!r} at concurrency {concurrency} after "
                     f"{len(prefix)} tokens (not the states of this baseline's text)")


def judge_divergences(speculative, states, head, outputs_path):
    """Each divergence of every temperature-0 run of the engines' files `speculative`, judged on
    the agreement states `states` (of vllm_baseline's `outputs_path`) with the target's head
    `head`, at the dtype its engine computed in: adds margin, tolerance and near_tie to each;
    fails with one line on the first that is not a near-tie. The tolerance is judge's, or the
    largest lead the recomputed target gives a speculative token over the baseline's in these runs
    (the engine's accumulated rounding, shown by the run itself: a fault only ever makes the
    baseline's token lead; on the Kimi-shaped demo in bfloat16 the speculative token led by up to
    0.18, the baseline's by up to 0.062)."""
    texts = baseline_texts(outputs_path)
    by_id = {sample_id: i for i, (_, _, _, sample_id) in enumerate(states.samples.index)}
    states_dtype = states.info["dtype"]
    judged = []
    for spec in speculative:
        engine_dtype = spec["engine_dtype"]
        for run in spec["runs"]:
            for d in run.get("divergences", []):
                at, c = d["generated_token"], run["concurrency"]
                where = (f"{spec['draft_sample_method']} K={spec['num_speculative_tokens']} {run['suite']} T=0 c={c}, "
                         f"prompt {d['id']!r}, generated token {at}")
                if d["speculative_token"] is None or d["baseline_token"] is None:
                    raise InputError(f"{where}: speculation changed the greedy text, one of the two texts ends there "
                                     f"(baseline token {d['baseline_token']}, speculative {d['speculative_token']}): "
                                     "a fault, not numerics")
                prompt, continuation = texts[run["suite"], c, d["id"]]
                state = final_state(states, by_id, run["suite"], c, d["id"], prompt + continuation[:at])
                tokens = torch.tensor([d["baseline_token"], d["speculative_token"]], device=head.lm_head.device)
                logits, sums = head.logits(state, tokens)
                d |= judge(*logits.tolist(), engine_dtype, states_dtype, magnitude=float(sums.sum()) / 2)
                judged.append((where, d, engine_dtype))
    # Where the recomputed target prefers the speculative token, its two computations disagree by
    # that much: rounding this run's engine shows, which the same tolerance allows the other way.
    shown = max((-d["margin"] for _, d, _ in judged), default=0.0)
    for where, d, engine_dtype in judged:
        d["tolerance"] = max(d["tolerance"], shown)
        d["near_tie"] = d["margin"] <= d["tolerance"]
        log.info("%s: baseline token %d, speculative %d, margin %.4g (tolerance %.3g in %s): %s", where,
                 d["baseline_token"], d["speculative_token"], d["margin"], d["tolerance"], engine_dtype,
                 "near-tie, numerics" if d["near_tie"] else "FAULT")
    for where, d, engine_dtype in judged:
        if not d["near_tie"]:
            raise InputError(
                f"{where}: speculation emitted token {d['speculative_token']} where the baseline has "
                f"{d['baseline_token']}, and the target's logits there differ by {d['margin']:.4g}, beyond the "
                f"{d['tolerance']:.3g} that {engine_dtype} rounding can swap: a fault in drafting or verification, "
                "not numerics (docs/EVALUATION.md, greedy identity)")
