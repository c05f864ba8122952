"""The drafter in real vLLM: acceptance and speed-up, and proof that vLLM runs the drafter we trained.

The target answers the held-out prompts greedily in vLLM, once alone and once with the drafter.
Speculation must not change the text. vLLM's own counters give the online acceptance. The same
continuations then go through the offline evaluator: HF hidden states, and the drafter built
from the trained weights with the settings training used, the manifest's aux layers and the
vocab stage's d2t, chain-drafting K tokens at the anchors vLLM drafts from. Both must agree per
position. When they do not, vLLM read the drafter differently from how it was trained (the
silent mismatches: aux layer ids in another convention, a norm flag defaulted the other way, a
d2t in another form), and the run fails naming the reading that reproduces vLLM's numbers.
"""

import dataclasses
import json
import logging
from pathlib import Path

import torch

from eaglenest.atomic import atomic_path, write_json
from eaglenest.drafter import DrafterConfig
from eaglenest.evaluate import acceptance, acceptance_fields, accepted_lengths, served_anchors
from eaglenest.export import load_drafter
from eaglenest.hidden_states import capture_states, default_aux_layer_ids, load_target
from eaglenest.stage import InputError
from eaglenest.tokenized import read_tokenized
from eaglenest.train import is_heldout, load_vocab, read_target_tensors
from eaglenest.vllm_run import generate

log = logging.getLogger(__name__)


def heldout_prompts(tokenized_path, heldout_fraction, max_prompts):
    """(ids, prompt token ids) of the held-out samples: each sample's tokens before its first
    generated one, exactly what the target was asked."""
    ids, prompts = [], []
    for sample in read_tokenized(tokenized_path):
        if is_heldout(sample["id"], heldout_fraction) and len(ids) < max_prompts:
            ids.append(sample["id"])
            prompts.append(sample["input_ids"][: sample["loss_mask"].index(1)])
    if not ids:
        raise InputError(f"{tokenized_path}: no held-out samples (train.heldout_fraction {heldout_fraction})")
    return ids, prompts


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
                     prompts, continuations, counters, *, num_speculative_tokens, agreement_tolerance):
    """vLLM's acceptance (`counters`, from drafting on `continuations`) against the offline
    evaluator's on the same text -> (online, offline, largest gap per position); InputError
    naming the misreadings that reproduce vLLM's numbers when the gap exceeds the tolerance."""
    K = num_speculative_tokens
    online = online_acceptance(counters)
    manifest = json.loads(Path(manifest_path).read_text())
    aux_layer_ids = list(manifest["aux_layer_ids"])
    trained = DrafterConfig(**json.loads(Path(trained_config_path).read_text()))
    d2t, t2d = load_vocab(d2t_path, t2d_path)
    embed = read_target_tensors(target_dir, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    drafter = trained_drafter(drafter_dir, trained, d2t, t2d, embed)
    model = load_target(target_dir, "float32", "cpu")
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


def evaluate_vllm(tokenized_path, target_dir, drafter_dir, trained_config_path, manifest_path, d2t_path, t2d_path,
                  metrics_path, outputs_path, *, heldout_fraction, num_speculative_tokens, max_tokens,
                  max_prompts, concurrency, agreement_tolerance, vllm):
    """Run the target in vLLM without and with the drafter on the held-out prompts; write the
    greedy continuations (JSONL) and vllm_metrics.json; fail when speculation changed the text
    or when vLLM's acceptance disagrees with the offline evaluator on that text.
    `concurrency` requests run at once: speculation pays off when decoding is latency-bound."""
    K = num_speculative_tokens
    ids, prompts = heldout_prompts(tokenized_path, heldout_fraction, max_prompts)
    log.info("%d held-out prompts, %d tokens each at most, K=%d", len(prompts), max_tokens, K)
    plain = generate(target_dir, prompts, max_tokens=max_tokens, max_num_seqs=concurrency, **vllm)
    log.info("without speculation: %.0f tok/s", plain["tokens_per_s"])
    spec = generate(target_dir, prompts, max_tokens=max_tokens, max_num_seqs=concurrency, drafter_dir=drafter_dir,
                    num_speculative_tokens=K, **vllm)
    log.info("with the drafter: %.0f tok/s, counters %s", spec["tokens_per_s"], spec["counters"])
    with atomic_path(outputs_path) as tmp, open(tmp, "w") as f:
        for sample_id, prompt, tokens in zip(ids, prompts, plain["token_ids"]):
            f.write(json.dumps({"id": sample_id, "prompt_token_ids": prompt, "token_ids": tokens}) + "\n")
    changed = [i for i, (a, b) in enumerate(zip(plain["token_ids"], spec["token_ids"])) if a != b]
    if changed:
        a, b = plain["token_ids"][changed[0]], spec["token_ids"][changed[0]]
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise InputError(f"speculation changed the greedy text of {len(changed)}/{len(prompts)} prompts, "
                         f"first {ids[changed[0]]!r} at generated token {at}")
    online, offline, gap = verify_agreement(
        target_dir, drafter_dir, trained_config_path, manifest_path, d2t_path, t2d_path, prompts,
        plain["token_ids"], spec["counters"], num_speculative_tokens=K, agreement_tolerance=agreement_tolerance)
    metrics = {
        "vllm_version": plain["vllm_version"],
        "num_speculative_tokens": K,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "generated_tokens": plain["generated_tokens"],
        **online,
        "tokens_per_s_without_speculation": plain["tokens_per_s"],
        "tokens_per_s_with_speculation": spec["tokens_per_s"],
        "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
        "greedy_text_unchanged": True,
        "offline_on_vllm_text": offline,
        "max_disagreement": gap,
        "agreement_tolerance": agreement_tolerance,
    }
    log.info("vLLM metrics: %s", json.dumps(metrics))
    write_json(metrics_path, metrics)
    return metrics
