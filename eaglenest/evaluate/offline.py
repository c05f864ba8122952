"""Offline acceptance of a drafter on the held-out samples of the shards (see
eaglenest.evaluate.acceptance for how drafts are counted).

The reference is the data tokens: this equals vLLM's greedy acceptance when the data is the
target's greedy output; for sampled data it estimates acceptance against those samples.
"""

import logging
from pathlib import Path

from eaglenest.data.samples import is_heldout
from eaglenest.data.tokenizer import tool_call_span
from eaglenest.drafter.load import load_drafter
from eaglenest.drafter.target_head import TargetHead
from eaglenest.evaluate.acceptance import (acceptance, accepted_lengths, chain_lengths, drafts_in_span, oracle_drafts,
                                           served_anchors, share_of_ceiling)
from eaglenest.states.manifest import read_manifest
from eaglenest.states.shards import ShardSamples, check_shards, collate, dequantize_states, length_batches
from eaglenest.workflow.atomic import write_json
from eaglenest.workflow.device import torch_device
from eaglenest.workflow.progress import ProgressLines
from eaglenest.workflow.tracking import log_acceptance, open_trackers

log = logging.getLogger(__name__)


def tool_call_split(span, ids, anchors, lengths):
    """A batch's served drafts (served_anchors) split by where each starts: ([accepted lengths of
    those starting in a tool-call span], [of the others]); ([], []) without a span (the ids of the
    section's begin and end)."""
    inside, spans, rest = drafts_in_span(ids, *span).tolist() if span else [], [], []
    for sample_anchors, sample_lengths, keep in zip(anchors, lengths, inside):
        spans += served_anchors(sample_anchors, sample_lengths, keep)
        rest += served_anchors(sample_anchors, sample_lengths, [not x for x in keep])
    return spans, rest


def served_figures(served, ceiling, K, split):
    """The "served" figures: acceptance at vLLM's anchors, the ceiling's and the share of it, and
    with a tool-call `split` (tool_call_split's, whole run) its two parts."""
    fields = acceptance(served, K)
    fields["ceiling_per_position"] = acceptance(ceiling, K)["acceptance_rate_per_position"]
    fields["share_of_ceiling_per_position"] = share_of_ceiling(fields["acceptance_rate_per_position"],
                                                               fields["ceiling_per_position"])
    if split:
        fields["tool_call_spans"], fields["outside_tool_call_spans"] = (acceptance(s, K) for s in split)
    return fields


def evaluate_offline(
    shard_paths,
    manifest_path,
    drafter_dir,
    target_dir,
    out_path,
    *,
    heldout_fraction,
    num_speculative_tokens,
    max_tokens_per_batch=4096,
    device=None,
    tracking=None,
    trust_remote_code=False, tool_call_tokens=None,
):
    """Write the acceptance of `drafter_dir` on the held-out samples as JSON; return it.

    Fields mirror vLLM's spec-decode counters: num_drafts, num_draft_tokens (K per draft),
    num_accepted_tokens, acceptance_rate_per_position (accepted at depth k / num_drafts) and
    mean_acceptance_length = 1 + their sum. Top level: a draft at every anchor. "served": only
    at the anchors vLLM itself drafts from (see served_anchors), comparable to vLLM's counters
    on the same greedy data (on a tiny target they matched vLLM CPU's exactly, except that
    vLLM also verifies drafts past max_tokens, which the data cannot). Acceptance clusters, so
    the every-anchor rates read higher than the served ones. "served" also has the ceiling at
    temperature 0 on this text (an oracle drafting the target's argmax, read from the shards'
    final states: 1 where the data is greedy target output, lower on sampled data) and the
    drafter's share of it.

    The samples go through in batches of similar length within `max_tokens_per_batch` padded
    tokens (speed only: each sample's drafts are its own, so the figures do not change).

    `tracking`: the config's tracking section (None: none; eaglenest.workflow.tracking), whose
    trackers get the acceptance per position, every anchor's and served, as run evaluate_offline
    (TensorBoard: tensorboard/evaluate_offline beside out_path). tool_call_tokens: tool_call_split.
    """
    device = torch_device(device)
    manifest = read_manifest(manifest_path)
    check_shards(shard_paths, manifest)
    head = TargetHead(target_dir, device)  # the drafter's embedding; its argmax drafts the ceiling
    drafter = load_drafter(drafter_dir, head.embed_tokens).to(device)
    aux_layer_ids = drafter.config.aux_layer_ids
    if aux_layer_ids != list(manifest["aux_layer_ids"]):
        raise ValueError(f"drafter aux layers {aux_layer_ids} != shards' {manifest['aux_layer_ids']}")
    samples = ShardSamples(shard_paths, keep=lambda i: is_heldout(i, heldout_fraction))
    dtype = next(drafter.parameters()).dtype
    K = num_speculative_tokens
    span = tool_call_span(target_dir, trust_remote_code=trust_remote_code, tool_call_tokens=tool_call_tokens)

    every, served, ceiling, generated, split = [], [], [], 0, ([], [])
    sizes = [end - start for _, start, end, _ in samples.index]
    ticker = ProgressLines("offline evaluation", len(samples), "samples", logger=log, rate_of="tokens")
    for indices in length_batches(range(len(samples)), sizes, max_tokens_per_batch):
        batch = collate([samples[i] for i in indices])  # in the stored dtype: chain_drafts casts a chunk at a time
        batch = dequantize_states({k: t.to(device) for k, t in batch.items()}, dtype)  # FP8: dequantized here
        anchors, lengths = accepted_lengths(drafter, batch, K)
        _, oracle = chain_lengths(oracle_drafts(head.argmax(batch["final_hidden_states"]), K), batch)
        for sample_anchors, sample_lengths, oracle_lengths in zip(anchors.tolist(), lengths.tolist(), oracle.tolist()):
            every += [a for a, is_anchor in zip(sample_lengths, sample_anchors) if is_anchor]
            served += served_anchors(sample_anchors, sample_lengths)
            ceiling += served_anchors(sample_anchors, oracle_lengths)
        for whole, part in zip(split, tool_call_split(span, batch["input_ids"], anchors.tolist(), lengths.tolist())):
            whole += part
        generated += int(batch["loss_mask"].sum())
        ticker.advance(len(indices), work=sum(sizes[i] for i in indices))

    served_fields = served_figures(served, ceiling, K, split if span else None)
    result = {
        "num_speculative_tokens": K,
        **acceptance(every, K),
        "served": served_fields,
        "heldout_samples": len(samples),
        "heldout_tokens": samples.num_tokens(),
        "heldout_generated_tokens": generated,
        "reference": "data tokens (= vLLM greedy acceptance when the data is greedy target output)",
    }
    log.info("offline acceptance: %s", result)
    write_json(out_path, result)
    with open_trackers(tracking, Path(out_path).parent, "evaluate_offline") as trackers:
        log_acceptance(trackers, {f"offline/heldout/K{K}/every_anchor": result, f"offline/heldout/K{K}/served": served_fields})
    return result
