"""Proof that vLLM runs the drafter we trained: its acceptance counters against the offline
evaluator's on the same text.

The offline side reads the target's hidden states of vLLM's continuations from the agreement
states (eaglenest.evaluate.agreement_states: taken by the hidden_states stage's backend, never by a
second copy of the target; of the target only the embedding is read here), and builds the drafter
from the trained weights with the settings training used, the manifest's aux layers and the vocab
stage's d2t, chain-drafting K tokens at the anchors vLLM drafts from. Both must agree per position.
When they do not, vLLM read the drafter differently from how it was trained (the silent
mismatches: aux layer ids in another convention, a norm flag defaulted the other way, a d2t in
another form), and the run fails naming the reading that reproduces vLLM's numbers.
"""

import dataclasses
import json
import logging
from pathlib import Path

import torch

from eaglenest.data.target import read_target_embedding
from eaglenest.data.vocab import load_vocab
from eaglenest.drafter.load import drafter_from_state, load_drafter
from eaglenest.drafter.model import DrafterConfig
from eaglenest.evaluate.acceptance import acceptance, acceptance_fields, accepted_lengths, served_anchors
from eaglenest.evaluate.agreement_states import AgreementStates, layer_misreadings
from eaglenest.states.manifest import read_manifest
from eaglenest.workflow.atomic import write_json
from eaglenest.workflow.device import torch_device
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.progress import ProgressLines

log = logging.getLogger(__name__)


def online_acceptance(counters):
    """vLLM's spec-decode counters -> the fields of eaglenest.evaluate.acceptance."""
    return acceptance_fields(
        int(counters["num_drafts"]),
        int(counters["num_draft_tokens"]),
        int(counters["num_accepted_tokens"]),
        [int(n) for n in counters["num_accepted_tokens_per_position"]],
    )


def largest_gap(a, b):
    """The largest per-position difference between two acceptance results."""
    return max(abs(x - y) for x, y in zip(a["acceptance_rate_per_position"], b["acceptance_rate_per_position"]))


def trained_drafter(drafter_dir, trained_config, d2t, t2d, embed_tokens):
    """The drafter as trained: weights from `drafter_dir`, everything else from its sources."""
    drafter = load_drafter(drafter_dir, embed_tokens, config=trained_config)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    return drafter


@torch.no_grad()
def offline_acceptances(states, variants, K, device):
    """Offline acceptance (vLLM's served anchors) of each (drafter, aux layer ids) of `variants` on
    the prompt + continuation samples of `states` (an AgreementStates), in one pass over them."""
    columns = [states.columns(layer_ids) for _, layer_ids in variants]
    lengths = [[] for _ in variants]
    ticker = ProgressLines("agreement check", len(states), "samples", logger=log)
    for i in range(len(states)):
        sample = states[i]
        for (drafter, _), cols, drafted in zip(variants, columns, lengths):
            batch = {
                "input_ids": sample["input_ids"][None].to(device),
                "loss_mask": sample["loss_mask"][None].to(device),
                "aux_hidden_states": sample["aux_hidden_states"][:, cols][None].to(device),
            }
            anchors, accepted = accepted_lengths(drafter, batch, K)
            drafted += served_anchors(anchors[0].tolist(), accepted[0].tolist())
        ticker.advance()
    return [acceptance(drafted, K) for drafted in lengths]


def misreadings(drafter, aux_layer_ids, num_layers):
    """The ways vLLM could read our drafter differently, as (description, drafter, aux ids)."""
    flag = drafter.config.norm_before_residual
    flipped = load_drafter_copy(drafter, norm_before_residual=not flag)
    out = [(f"norm_before_residual read as {not flag} (trained with {flag})", flipped, aux_layer_ids)]
    out += [(description, drafter, ids) for description, ids in layer_misreadings(aux_layer_ids, num_layers)]
    absolute = load_drafter_copy(drafter)
    absolute.d2t.copy_(drafter.draft_to_target(torch.arange(len(drafter.d2t), device=drafter.d2t.device)))
    out.append(("d2t read as absolute target ids instead of offsets", absolute, aux_layer_ids))
    return out


def load_drafter_copy(drafter, **changes):
    """`drafter` with DrafterConfig fields `changes` (e.g. a flipped norm flag): its weights, the
    embedding above all, shared rather than copied; vocab maps of its own (a misreading may change them)."""
    state = drafter.state_dict()
    state["d2t"], state["t2d"] = state["d2t"].clone(), state["t2d"].clone()
    return drafter_from_state(dataclasses.replace(drafter.config, **changes), state).eval()


def check_agreement(online, offline, tolerance, diagnose):
    """Raise InputError when vLLM's per-position acceptance is off the offline one by more than
    `tolerance`; `diagnose()` -> descriptions of the misreadings that reproduce vLLM's numbers."""
    worst = largest_gap(online, offline)
    if worst <= tolerance:
        return worst
    suspects = diagnose()
    cause = ("it matches the offline estimate when " + "; or when ".join(suspects)) if suspects else (
        "no known misreading reproduces it (check the target, dtype and vLLM version)")
    raise InputError(
        "vLLM does not run the drafter as trained: acceptance per position in vLLM "
        + " / ".join(f"{a:.2f}" for a in online["acceptance_rate_per_position"]) + ", offline on the same text "
        + " / ".join(f"{b:.2f}" for b in offline["acceptance_rate_per_position"]) + f" (tolerance {tolerance}); " + cause
    )


def verify_agreement(states_dir, target_dir, drafter_dir, trained_config_path, manifest_path, d2t_path, t2d_path,
                     counters, *, num_speculative_tokens, agreement_tolerance, device=None):
    """vLLM's acceptance (`counters`, from drafting on the continuations whose target states
    `states_dir` holds: eaglenest.evaluate.agreement_states) against the offline evaluator's on the
    same text -> (online, offline, largest gap per position); InputError naming the misreadings
    that reproduce vLLM's numbers when the gap exceeds the tolerance. Of the target only the
    embedding is read (from `target_dir`); the drafter runs on `device`."""
    K, device = num_speculative_tokens, torch_device(device)
    online = online_acceptance(counters)
    manifest = read_manifest(manifest_path)
    aux_layer_ids = list(manifest["aux_layer_ids"])
    states = AgreementStates(states_dir)
    if states.info["aux_layer_ids"] != aux_layer_ids:
        raise InputError(f"{states_dir}: states for aux layers {states.info['aux_layer_ids']}, "
                         f"the manifest's are {aux_layer_ids}")
    trained = DrafterConfig(**json.loads(Path(trained_config_path).read_text()))
    d2t, t2d = load_vocab(d2t_path, t2d_path)
    drafter = trained_drafter(drafter_dir, trained, d2t, t2d, read_target_embedding(target_dir)).to(device)
    log.info("offline side: %d samples of %s (%s backend, %s, layers %s); no target model loaded", len(states),
             states_dir, states.info["backend"], states.info["dtype"], states.info["layer_ids"])
    offline = offline_acceptances(states, [(drafter, aux_layer_ids)], K, device)[0]
    log.info("vLLM %s, offline %s", online["acceptance_rate_per_position"], offline["acceptance_rate_per_position"])

    def diagnose():
        variants = misreadings(drafter, aux_layer_ids, manifest["num_layers"])
        found = []
        rates = offline_acceptances(states, [(variant, ids) for _, variant, ids in variants], K, device)
        for (description, _, _), rate in zip(variants, rates):
            gap = largest_gap(rate, online)
            log.info("misreading %s: offline %s (largest gap to vLLM %.3f)", description,
                     rate["acceptance_rate_per_position"], gap)
            if gap <= agreement_tolerance:
                found.append(description)
        return found

    return online, offline, check_agreement(online, offline, agreement_tolerance, diagnose)


def evaluate_vllm(runs_path, outputs_path, states_dir, target_dir, drafter_dir, trained_config_path, manifest_path,
                  d2t_path, t2d_path, metrics_path, *, agreement_tolerance, device=None):
    """The evaluate_vllm stage: vllm_metrics.json, with vllm_runs' figures (`runs_path`) and the
    offline evaluator's acceptance on the same continuations (`outputs_path`), from their target
    states (`states_dir`, rule agreement_states) with the drafter on `device`; fails when vLLM's
    acceptance disagrees with it (verify_agreement)."""
    runs = json.loads(Path(runs_path).read_text())
    AgreementStates(states_dir).check_text(outputs_path)
    counters = runs.pop("counters")
    online, offline, gap = verify_agreement(
        states_dir, target_dir, drafter_dir, trained_config_path, manifest_path, d2t_path, t2d_path, counters,
        num_speculative_tokens=runs["num_speculative_tokens"], agreement_tolerance=agreement_tolerance, device=device)
    metrics = {**runs, **online, "offline_on_vllm_text": offline, "max_disagreement": gap,
               "agreement_tolerance": agreement_tolerance}
    log.info("vLLM metrics: %s", json.dumps(metrics))
    write_json(metrics_path, metrics)
    return metrics
