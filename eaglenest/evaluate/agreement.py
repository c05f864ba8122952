"""Proof that vLLM runs the drafter we trained: its acceptance counters against the offline
evaluator's on the same text.

The offline side uses HF hidden states, and the drafter built from the trained weights with the
settings training used, the manifest's aux layers and the vocab stage's d2t, chain-drafting K
tokens at the anchors vLLM drafts from. Both must agree per position. When they do not, vLLM
read the drafter differently from how it was trained (the silent mismatches: aux layer ids in
another convention, a norm flag defaulted the other way, a d2t in another form), and the run
fails naming the reading that reproduces vLLM's numbers.
"""

import dataclasses
import json
import logging
from pathlib import Path

import torch

from eaglenest.data.target import read_target_embedding
from eaglenest.data.vocab import load_vocab
from eaglenest.drafter.load import load_drafter
from eaglenest.drafter.model import DrafterConfig
from eaglenest.evaluate.acceptance import acceptance, acceptance_fields, accepted_lengths, served_anchors
from eaglenest.states.convention import default_aux_layer_ids
from eaglenest.states.hf import capture_states, load_target
from eaglenest.states.manifest import read_manifest
from eaglenest.workflow.errors import InputError

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
def offline_acceptance(model, drafter, aux_layer_ids, prompts, continuations, K):
    """Offline acceptance (vLLM's served anchors) of `drafter` on prompt + continuation pairs."""
    lengths = []
    for prompt, continuation in zip(prompts, continuations):
        input_ids = torch.tensor(prompt + continuation, dtype=torch.int64)
        aux, _ = capture_states(model, input_ids, aux_layer_ids)
        batch = {
            "input_ids": input_ids[None],
            "loss_mask": torch.tensor([False] * len(prompt) + [True] * len(continuation))[None],
            "aux_hidden_states": aux[None].float(),
        }
        anchors, accepted = accepted_lengths(drafter, batch, K)
        lengths += served_anchors(anchors[0].tolist(), accepted[0].tolist())
    return acceptance(lengths, K)


def misreadings(drafter, aux_layer_ids, num_layers):
    """The ways vLLM could read our drafter differently, as (description, drafter, aux ids)."""
    flag = drafter.config.norm_before_residual
    flipped = load_drafter_copy(drafter, norm_before_residual=not flag)
    out = [(f"norm_before_residual read as {not flag} (trained with {flag})", flipped, aux_layer_ids)]
    for shift in (-1, 1):
        ids = [k + shift for k in aux_layer_ids]
        if all(0 <= k < num_layers for k in ids):
            out.append((f"aux layer ids read as {ids} (trained on {aux_layer_ids}: another convention)", drafter, ids))
    default = default_aux_layer_ids(num_layers)
    if default != list(aux_layer_ids):
        out.append((f"aux layer ids read as vLLM's default {default} (trained on {aux_layer_ids})", drafter, default))
    absolute = load_drafter_copy(drafter)
    absolute.d2t.copy_(drafter.draft_to_target(torch.arange(len(drafter.d2t))))
    out.append(("d2t read as absolute target ids instead of offsets", absolute, aux_layer_ids))
    return out


def load_drafter_copy(drafter, **changes):
    """A copy of `drafter` with DrafterConfig fields `changes` (e.g. a flipped norm flag)."""
    copy = type(drafter)(dataclasses.replace(drafter.config, **changes))
    copy.load_state_dict(drafter.state_dict())
    return copy.eval()


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


def verify_agreement(target_dir, drafter_dir, trained_config_path, manifest_path, d2t_path, t2d_path,
                     prompts, continuations, counters, *, num_speculative_tokens, agreement_tolerance,
                     trust_remote_code):
    """vLLM's acceptance (`counters`, from drafting on `continuations`) against the offline
    evaluator's on the same text -> (online, offline, largest gap per position); InputError
    naming the misreadings that reproduce vLLM's numbers when the gap exceeds the tolerance."""
    K = num_speculative_tokens
    online = online_acceptance(counters)
    manifest = read_manifest(manifest_path)
    aux_layer_ids = list(manifest["aux_layer_ids"])
    trained = DrafterConfig(**json.loads(Path(trained_config_path).read_text()))
    d2t, t2d = load_vocab(d2t_path, t2d_path)
    drafter = trained_drafter(drafter_dir, trained, d2t, t2d, read_target_embedding(target_dir))
    model = load_target(target_dir, "float32", "cpu", trust_remote_code=trust_remote_code)
    offline = offline_acceptance(model, drafter, aux_layer_ids, prompts, continuations, K)
    log.info("vLLM %s, offline %s", online["acceptance_rate_per_position"], offline["acceptance_rate_per_position"])

    def diagnose():
        found = []
        for description, variant, layer_ids in misreadings(drafter, aux_layer_ids, manifest["num_layers"]):
            rates = offline_acceptance(model, variant, layer_ids, prompts, continuations, K)
            gap = largest_gap(rates, online)
            log.info("misreading %s: offline %s (largest gap to vLLM %.3f)", description,
                     rates["acceptance_rate_per_position"], gap)
            if gap <= agreement_tolerance:
                found.append(description)
        return found

    return online, offline, check_agreement(online, offline, agreement_tolerance, diagnose)
