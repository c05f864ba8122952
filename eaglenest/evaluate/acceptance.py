"""Acceptance as vLLM counts it, from a drafter's chain drafts on known text: shared by the offline
evaluation and the check of vLLM's counters against it.

At every anchor t whose input token x_{t+1} was generated and is not the last generated token
(after it the request is over and vLLM drafts nothing), the drafter drafts K tokens; depth k
is accepted iff the d2t-mapped argmax of step k equals x_{t+k+2}, that token was generated,
and all shallower depths were accepted. Teacher forcing (the TTT forward) equals real chain
drafting as long as the drafts are accepted, which is all that counts here.
"""

import torch

from eaglenest.drafter.model import cached_attend, shift_left

# Anchors drafted at once: a chunk holds [B, ANCHOR_CHUNK, N] logits and [.., ANCHOR_CHUNK, T]
# scores, where the TTT forward over whole samples would hold [B, T, N] logits per step.
ANCHOR_CHUNK = 256


def chain_steps(drafter, ids, aux, num_speculative_tokens, chunk=ANCHOR_CHUNK):
    """The TTT forward, `chunk` anchors at a time over a KV cache (cached_attend): yields (span,
    k, step k's logits [B, chunk, N] at the anchors of `span`). ids [B, T], aux [B, T, 3Ht] in any
    dtype (a chunk's is cast where it enters fc): memory grows with T, not T² nor T × N."""
    reads = [shift_left(ids, k + 1, 0) for k in range(num_speculative_tokens)]  # step k at anchor t reads x_{t+k+1}
    positions, cache = torch.arange(ids.shape[1], device=ids.device), []
    for start in range(0, ids.shape[1], chunk):
        span = slice(start, start + chunk)
        hidden = drafter.fuse(aux[:, span].to(drafter.fc.weight.dtype))
        attend = cached_attend(cache, start)
        for k in range(num_speculative_tokens):
            logits, hidden = drafter.step(reads[k][:, span], hidden, positions[span] + k, attend)
            yield span, k, logits


@torch.no_grad()
def chain_drafts(drafter, ids, aux, num_speculative_tokens, chunk=ANCHOR_CHUNK):
    """What greedy drafting drafts (chain_steps): per step k, [B, T] target ids, step k's argmax
    at every anchor."""
    drafts = [torch.zeros_like(ids) for _ in range(num_speculative_tokens)]
    for span, k, logits in chain_steps(drafter, ids, aux, num_speculative_tokens, chunk):
        drafts[k][:, span] = drafter.draft_to_target(logits.argmax(-1))
    return drafts


@torch.no_grad()
def chain_distributions(drafter, ids, aux, num_speculative_tokens, temperature, chunk=ANCHOR_CHUNK):
    """What probabilistic drafting samples from (chain_steps): per step k, [B, T, N] float32,
    softmax(logits / temperature) over the draft vocab at every anchor, as vLLM's proposer computes
    the draft probabilities it keeps for the rejection sampler (zero outside the draft vocab)."""
    out = [None] * num_speculative_tokens
    for span, k, logits in chain_steps(drafter, ids, aux, num_speculative_tokens, chunk):
        q = (logits.float() / temperature).softmax(-1)
        if out[k] is None:
            out[k] = q.new_zeros(*ids.shape, q.shape[-1])
        out[k][:, span] = q
    return out


@torch.no_grad()
def accepted_lengths(drafter, batch, num_speculative_tokens, chunk=ANCHOR_CHUNK):
    """-> (anchors [B, T] bool, accepted [B, T]: tokens accepted of the K drafted at anchor t)."""
    return chain_lengths(chain_drafts(drafter, batch["input_ids"], batch["aux_hidden_states"], num_speculative_tokens,
                                      chunk), batch)


def oracle_drafts(target_argmax, num_speculative_tokens):
    """The drafts of an oracle that drafts the target's own greedy token, in chain_drafts' layout:
    target_argmax [B, T] (the target's argmax after position s) -> per step k, [B, T], the guess
    at x_{t+k+2}, which is the argmax after position t+k+1. No drafter accepts more in vLLM,
    which accepts a draft d with probability p_T(d) <= max p_T (eaglenest.evaluate.expected)."""
    return [shift_left(target_argmax, k + 1, -1) for k in range(num_speculative_tokens)]


def draft_anchors(generated):
    """generated [B, T] bool -> [B, T] bool: the anchors t vLLM drafts from, where x_{t+1} was
    generated and is not the last generated token (x_{t+2} was generated too)."""
    return shift_left(generated, 1, False) & shift_left(generated, 2, False)


def chain_hits(drafts, ids, generated):
    """Chain drafts (per step k, [B, T]: a guess at x_{t+k+2}) on the text ids [B, T] -> [K, B, T]
    bool: depth k's draft equals the text, at a token the target generated."""
    return torch.stack([(d == shift_left(ids, k + 2, -1)) & shift_left(generated, k + 2, False)
                        for k, d in enumerate(drafts)])


def chain_matches(drafts, ids, generated):
    """chain_hits() through depth k: [K, B, T] bool, depth k's draft and every shallower one equal
    the text. At temperature 0 that is vLLM's acceptance; above it, the indicator
    (eaglenest.evaluate.expected)."""
    return chain_hits(drafts, ids, generated).cumprod(0).bool()


def chain_lengths(drafts, batch):
    """Chain drafts (per step k, [B, T] target ids) on the text of `batch` -> (anchors [B, T] bool,
    accepted [B, T]: tokens accepted of the K drafted at anchor t, at temperature 0; 0 elsewhere)."""
    generated = batch["loss_mask"].bool()
    anchors = draft_anchors(generated)
    return anchors, (chain_matches(drafts, batch["input_ids"], generated) & anchors).sum(0)


def served_positions(anchors, lengths):
    """The anchors vLLM drafts from while generating this sample: after a draft at t with a tokens
    accepted, the target adds one token, so the next draft is at t+a+1. anchors, lengths: lists
    over one sample's positions (lengths: tokens accepted of a draft at t)."""
    drafted, t = [], 0
    while t < len(anchors):
        if anchors[t]:
            drafted.append(t)
            t += lengths[t] + 1
        else:
            t += 1
    return drafted


def steps_on_text(accepted, drafted, end, K):
    """One request's vLLM steps (per-step accepted and drafted counts, per_request_spec_decode_metrics
    "detailed") whose K guesses all fall on its first `end` generated tokens, as (anchor, accepted,
    drafted) triples. vLLM's first step drafts after generated token 0; a step whose anchor is generated token
    g guesses g+1 .. g+K and moves the anchor by its accepted tokens plus the target's own
    (served_positions' walk), so it is kept iff g + K < end. vLLM counts a step's accepted drafts
    before it trims them at a stop token or max_tokens (vllm/v1/core/sched/scheduler.py 2115-2148
    against 2167 and 2515): on short answers its counters hold accepts past the text's end that no
    replay of the text can see (docs/VLLM.md)."""
    kept, g = [], 0
    for a, n in zip(accepted, drafted):
        if g + K >= end:
            break
        kept.append((g, a, n))
        g += a + 1
    return kept


def step_counters(steps, K):
    """vLLM's spec-decode counters (generation's `counters` shape) of steps_on_text's steps."""
    per_position = [sum(a > k for _, a, _ in steps) for k in range(K)]
    return {"num_drafts": len(steps), "num_draft_tokens": sum(n for _, _, n in steps),
            "num_accepted_tokens": sum(per_position), "num_accepted_tokens_per_position": per_position}


def common_text_counters(accepted_per_step, drafted_per_step, ends, K):
    """vLLM's spec-decode counters of only the steps whose K guesses all fall on the text it
    compares (steps_on_text): ends[i], request i's generated tokens that count (its text's length,
    or less where it leaves the text the offline side replays). Offline, expected.sample_counts
    keeps the same anchors of a text served that far."""
    return step_counters([step for accepted, drafted, end in zip(accepted_per_step, drafted_per_step, ends)
                          for step in steps_on_text(accepted, drafted, end, K)], K)


def span_counters(prompts, outputs, accepted_per_step, drafted_per_step, ends, span, K):
    """vLLM's drafts of the steps common_text_counters counts, split as drafts_in_span splits the
    offline ones: {"tool_call_spans", "outside_tool_call_spans"}, each in its shape. A step whose
    anchor is generated token g (steps_on_text's) drafts first generated token g+1 of the
    request's text, prompt + output: the draft is the span's iff that token is in one (span_mask).
    prompts, outputs: per request, its prompt's and its generated token ids; span: (begin, end) ids."""
    parts = ([], [])  # the steps in a span, the others
    for prompt, output, accepted, drafted, end in zip(prompts, outputs, accepted_per_step, drafted_per_step, ends):
        inside = span_mask(torch.tensor(list(prompt) + list(output)), *span)[len(prompt):].tolist()
        for step in steps_on_text(accepted, drafted, end, K):
            parts[0 if inside[step[0] + 1] else 1].append(step)
    return {name: step_counters(steps, K) for name, steps in zip(("tool_call_spans", "outside_tool_call_spans"), parts)}


def request_counts(accepted_per_step, drafted_per_step, ends, K):
    """Per request, its drafts and its accepted drafts at each position, of the steps
    common_text_counters counts: {"drafts": [n], "accepted_per_position": [[a_1 .. a_K]]}: the
    spread of vLLM's own sample, by prompt, for the agreement check's standard errors."""
    kept = [[a for _, a, _ in steps_on_text(accepted, drafted, end, K)]
            for accepted, drafted, end in zip(accepted_per_step, drafted_per_step, ends)]
    return {"drafts": [len(steps) for steps in kept],
            "accepted_per_position": [[sum(a > k for a in steps) for k in range(K)] for steps in kept]}


def served_anchors(anchors, lengths, keep=None):
    """Accepted lengths at served_positions; keep: a list over the positions, True at the drafts
    to count (None: all; e.g. those drafting into a tool-call span, drafts_in_span)."""
    return [lengths[t] for t in served_positions(anchors, lengths) if keep is None or keep[t]]


def span_mask(ids, begin, end):
    """ids [..., T] -> [..., T] bool: the tokens of every span from a `begin` token through the
    next `end` token, both in (a tool-call section: <|tool_calls_section_begin|> to
    <|tool_calls_section_end|>); a span still open at the end of the text runs to it, an `end`
    with no `begin` before it opens none."""
    positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    last_begin = torch.where(ids == begin, positions, -1).cummax(-1).values
    last_end = torch.where(ids == end, positions, -1).cummax(-1).values
    last_end_before = torch.cat([torch.full_like(last_end[..., :1], -1), last_end[..., :-1]], -1)
    return last_begin > last_end_before


def drafts_in_span(ids, begin, end):
    """ids [..., T] -> [..., T] bool: the anchors t whose draft starts inside a span (span_mask):
    its first drafted token, x_{t+2}, is in one. A draft is the span's or the rest's by where it
    starts, so the two split vLLM's drafts (and their counts) between them."""
    inside = span_mask(ids, begin, end)
    return torch.cat([inside[..., 2:], torch.zeros_like(inside[..., :2])], -1)


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


def share_of_ceiling(rates, ceiling):
    """Acceptance per position as a share of the ceiling's (an oracle drafting the target's argmax:
    oracle_drafts), None where the ceiling is 0."""
    return [a / c if c > 0 else None for a, c in zip(rates, ceiling)]


def acceptance(lengths, K):
    """vLLM-style counters from the accepted length of each draft."""
    per_position = [sum(a > k for a in lengths) for k in range(K)]
    return acceptance_fields(len(lengths), len(lengths) * K, sum(per_position), per_position)
