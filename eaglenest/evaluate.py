"""Offline acceptance of a drafter on held-out samples: chain drafting as vLLM does it.

At every anchor t whose input token x_{t+1} was generated and is not the last generated token
(after it the request is over and vLLM drafts nothing), the drafter drafts K tokens; depth k
is accepted iff the d2t-mapped argmax of step k equals x_{t+k+2}, that token was generated,
and all shallower depths were accepted. Teacher forcing (the TTT forward) equals real chain
drafting as long as the drafts are accepted, which is all that counts here.

The reference is the data tokens: this equals vLLM's greedy acceptance when the data is the
target's greedy output; for sampled data it estimates acceptance against those samples.
"""

import json
import logging
from pathlib import Path

import torch

from eaglenest.atomic import write_json
from eaglenest.drafter import shift_left
from eaglenest.export import load_drafter
from eaglenest.shards import ShardSamples, check_shards
from eaglenest.train import collate, is_heldout, read_target_tensors

log = logging.getLogger(__name__)


@torch.no_grad()
def accepted_lengths(drafter, batch, num_speculative_tokens):
    """-> (anchors [B, T] bool, accepted [B, T]: tokens accepted of the K drafted at anchor t)."""
    ids, generated = batch["input_ids"], batch["loss_mask"]
    logits = drafter(ids, batch["aux_hidden_states"], num_speculative_tokens)
    anchors = shift_left(generated, 1, False) & shift_left(generated, 2, False)
    chain = anchors.clone()
    lengths = torch.zeros_like(ids)
    for k, step_logits in enumerate(logits):
        drafted = drafter.draft_to_target(step_logits.argmax(-1))  # [B, T] target ids
        chain &= (drafted == shift_left(ids, k + 2, -1)) & shift_left(generated, k + 2, False)
        lengths += chain
    return anchors, lengths


def served_anchors(anchors, lengths):
    """Accepted lengths at the anchors vLLM drafts from while generating this sample: after a
    draft at t with a tokens accepted, the target adds one token, so the next draft is at t+a+1.
    anchors, lengths: lists over one sample's positions."""
    drafted, t = [], 0
    while t < len(anchors):
        if anchors[t]:
            drafted.append(lengths[t])
            t += lengths[t] + 1
        else:
            t += 1
    return drafted


def acceptance_fields(num_drafts, num_draft_tokens, num_accepted_tokens, per_position):
    """vLLM-style acceptance fields from the counts of drafts, drafted and accepted tokens, and
    accepted tokens per position; one shape for offline estimates and vLLM's own counters."""
    rates = [n / max(num_drafts, 1) for n in per_position]
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted_tokens,
        "num_accepted_tokens_per_position": per_position,
        "acceptance_rate_per_position": rates,
        "mean_acceptance_length": 1 + sum(rates),
    }


def acceptance(lengths, K):
    """vLLM-style counters from the accepted length of each draft."""
    per_position = [sum(a > k for a in lengths) for k in range(K)]
    return acceptance_fields(len(lengths), len(lengths) * K, sum(per_position), per_position)


def evaluate_offline(
    shard_paths,
    manifest_path,
    drafter_dir,
    target_dir,
    out_path,
    *,
    heldout_fraction,
    num_speculative_tokens,
    batch_size=8,
    device=None,
):
    """Write the acceptance of `drafter_dir` on the held-out samples as JSON; return it.

    Fields mirror vLLM's spec-decode counters: num_drafts, num_draft_tokens (K per draft),
    num_accepted_tokens, acceptance_rate_per_position (accepted at depth k / num_drafts) and
    mean_acceptance_length = 1 + their sum. Top level: a draft at every anchor. "served": only
    at the anchors vLLM itself drafts from (see served_anchors), comparable to vLLM's counters
    on the same greedy data (on a tiny target they matched vLLM CPU's exactly, except that
    vLLM also verifies drafts past max_tokens, which the data cannot). Acceptance clusters, so
    the every-anchor rates read higher than the served ones.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    manifest = json.loads(Path(manifest_path).read_text())
    check_shards(shard_paths, manifest)
    embed = read_target_tensors(target_dir, ["model.embed_tokens.weight"])
    drafter = load_drafter(drafter_dir, embed["model.embed_tokens.weight"]).to(device)
    aux_layer_ids = drafter.config.aux_layer_ids
    if aux_layer_ids != list(manifest["aux_layer_ids"]):
        raise ValueError(f"drafter aux layers {aux_layer_ids} != shards' {manifest['aux_layer_ids']}")
    samples = ShardSamples(shard_paths, keep=lambda i: is_heldout(i, heldout_fraction))
    K = num_speculative_tokens

    every, served, generated = [], [], 0
    for start in range(0, len(samples), batch_size):
        batch = collate([samples[i] for i in range(start, min(start + batch_size, len(samples)))])
        anchors, lengths = accepted_lengths(drafter, {k: t.to(device) for k, t in batch.items()}, K)
        for sample_anchors, sample_lengths in zip(anchors.tolist(), lengths.tolist()):
            every += [a for a, is_anchor in zip(sample_lengths, sample_anchors) if is_anchor]
            served += served_anchors(sample_anchors, sample_lengths)
        generated += int(batch["loss_mask"].sum())

    result = {
        "num_speculative_tokens": K,
        **acceptance(every, K),
        "served": acceptance(served, K),
        "heldout_samples": len(samples),
        "heldout_tokens": samples.num_tokens(),
        "heldout_generated_tokens": generated,
        "reference": "data tokens (= vLLM greedy acceptance when the data is greedy target output)",
    }
    log.info("offline acceptance: %s", result)
    write_json(out_path, result)
    return result
