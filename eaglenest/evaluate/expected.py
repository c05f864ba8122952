"""Offline acceptance at any temperature, and how far vLLM's counters may fairly be from it.

vLLM's EAGLE drafts greedily (the drafter's argmax: SpeculativeConfig.draft_sample_method
"greedy", the only method with a draft vocabulary) and its rejection sampler treats such a draft
as one-hot: it accepts draft d with probability p_T(d), the target's probability at temperature T,
and on rejection samples from p_T with d left out. So the emitted token follows p_T, and the
draft was accepted iff the emitted token equals it. On a text the target sampled at T (the
baseline's), two estimates follow:

- indicator: the draft at depth k counts as accepted iff it and every shallower one equal the
  text, exactly as at temperature 0. Each anchor's outcome follows the same law as in vLLM's
  run, so this is what vLLM would count, on another sample.
- expected (what the comparison uses): given depths < k accepted, the context is the text itself,
  and depth k is accepted with probability p_T(d_k | text), read off the target's logits. The
  last indicator is replaced by that probability: Monte Carlo over the sampled texts, exact at
  each anchor's last step (a Rao-Blackwellised estimate: the same mean, less variance).

At temperature 0 both are the greedy count of eaglenest.evaluate.acceptance. vLLM drafts at the
anchors where the served run had a token to draft from (served_positions), which depend on the
run's own acceptances: the text's replay gives them the same law.

Standard errors are by prompt, the drafts of one response being correlated: for a rate
r = sum_i a_i / sum_i n_i over m prompts, SE = sqrt(m / (m - 1) * sum_i (a_i - r n_i)^2) / sum_i n_i.
vLLM's counters are a sample of the indicator's law on the same prompts, so their SE is the
indicator's; a gap is measured in sqrt(SE_indicator^2 + SE_expected^2).
"""

import math
from statistics import NormalDist

import torch

from eaglenest.drafter.model import shift_left
from eaglenest.evaluate.acceptance import (acceptance_fields, chain_drafts, chain_matches, draft_anchors, oracle_drafts,
                                           served_positions)


def shift_right(x, n, fill):
    """x[t - n] at index t of a 1-D tensor, `fill` before the start."""
    out = torch.full_like(x, fill)
    if n < len(x):
        out[n:] = x[: len(x) - n]
    return out


def _token_probs(sample, head, temperature, device):
    """replay()'s token_probs on one sample: the target's probabilities above temperature 0, else None."""
    if temperature == 0:
        return None
    final = sample["final_hidden_states"].to(head.lm_head.device)
    return lambda tokens: head.token_probs(final, tokens.to(final.device), temperature).to(device)


@torch.no_grad()
def chain_outcomes(drafter, sample, served_tokens, K, *, head=None, temperature=0.0):
    """replay() of the drafter's chain drafts (eaglenest.evaluate.acceptance.chain_drafts) on one
    sample: input_ids [T], loss_mask [T] (the continuation, possibly longer than served),
    aux_hidden_states [T, 3H] and final_hidden_states [T, H]. served_tokens: how many of the
    continuation's tokens the served run generated; head: the target's TargetHead, read above
    temperature 0."""
    ids = sample["input_ids"]
    drafts = [d[0] for d in chain_drafts(drafter, ids[None], sample["aux_hidden_states"][None], K)]
    return replay(ids, sample["loss_mask"].bool(), served_tokens, drafts, _token_probs(sample, head, temperature,
                                                                                     ids.device))


@torch.no_grad()
def ceiling_outcomes(sample, served_tokens, K, *, head, temperature):
    """chain_outcomes() of the oracle that drafts the target's own argmax (acceptance.oracle_drafts),
    from the sample's final_hidden_states through the target's norm and lm_head: the acceptance no
    drafter beats. At temperature 0 on greedy text every draft matches (ceiling 1); below 1 there
    means the states' argmax and the served text disagree (numerics). Above 0 each depth is
    accepted with probability max p_T."""
    ids = sample["input_ids"]
    target_argmax = head.argmax(sample["final_hidden_states"].to(head.lm_head.device)).to(ids.device)
    drafts = [d[0] for d in oracle_drafts(target_argmax[None], K)]
    return replay(ids, sample["loss_mask"].bool(), served_tokens, drafts, _token_probs(sample, head, temperature,
                                                                                     ids.device))


def replay(ids, generated, served_tokens, drafts, token_probs=None):
    """Chain drafts on a text -> (anchors [T] bool: vLLM drafts after x_{t+1}, a served token that
    is not the served run's last; matched [K, T] bool: depth k and every shallower one equal the
    text; probs [K, T]: the target's probability of depth k's draft, 0 where the text ends first,
    or None at temperature 0, where matched says it all).

    ids, generated [T]: the text and which of its tokens the target generated; drafts: K tensors
    [T], depth k's draft at every anchor t (a guess at x_{t+k+2}); token_probs(tokens [K, T]) ->
    [K, T]: the target's probability of tokens[k, s] as the token after position s."""
    served = generated & (generated.cumsum(0) <= served_tokens)
    anchors = draft_anchors(served[None])[0]
    matched = chain_matches([d[None] for d in drafts], ids[None], generated[None])[:, 0]
    if token_probs is None:
        return anchors, matched, None
    # depth k's draft at anchor t is the token after position t+k+1: read there, moved back to t
    at_position = token_probs(torch.stack([shift_right(d, k + 1, 0) for k, d in enumerate(drafts)]))
    verifiable = [shift_left(generated[None], k + 2, False)[0] for k in range(len(drafts))]  # x_{t+k+2} generated
    probs = torch.stack([shift_left(at_position[k][None], k + 1, 0.0)[0] * verifiable[k] for k in range(len(drafts))])
    return anchors, matched, probs


def sample_counts(anchors, matched, probs, K):
    """A sample's counts at the anchors vLLM drafts from with K tokens (matched/probs may hold
    more depths): (drafts, accepted per position by indicator [K], expected accepted [K])."""
    matched, probs = matched[:K], None if probs is None else probs[:K]
    lengths = matched.sum(0)
    positions = torch.tensor(served_positions(anchors.tolist(), lengths.tolist()), dtype=torch.long)
    indicator = matched[:, positions].sum(1).double()
    if probs is None:
        return len(positions), indicator.tolist(), indicator.tolist()
    reached = torch.cat([torch.ones(1, len(positions), dtype=torch.bool), matched[:-1, positions]])  # depths < k accepted
    expected = (reached * probs[:, positions]).sum(1).double()
    return len(positions), indicator.tolist(), expected.tolist()


def ratio_standard_error(numerators, denominators):
    """The by-prompt standard error of sum(numerators) / sum(denominators) (module docstring)."""
    m, total = len(denominators), sum(denominators)
    if m < 2 or total == 0:
        return math.inf
    rate = sum(numerators) / total
    return math.sqrt(m / (m - 1) * sum((a - rate * n) ** 2 for a, n in zip(numerators, denominators))) / total


def estimate(counts, K):
    """Per-sample counts (sample_counts) -> the expected acceptance (acceptance_fields, fractional
    counts), with "indicator_rate_per_position" and "standard_error_per_position" (of the
    expected and of vLLM's counters together: module docstring)."""
    drafts = [n for n, _, _ in counts]
    indicator = [[a[k] for _, a, _ in counts] for k in range(K)]
    expected = [[b[k] for _, _, b in counts] for k in range(K)]
    per_position = [sum(column) for column in expected]
    fields = acceptance_fields(sum(drafts), sum(drafts) * K, sum(per_position), per_position)
    fields["indicator_rate_per_position"] = [sum(column) / max(sum(drafts), 1) for column in indicator]
    fields["standard_error_per_position"] = [
        math.hypot(ratio_standard_error(indicator[k], drafts), ratio_standard_error(expected[k], drafts))
        for k in range(K)]
    return fields


def family_z(standard_errors, comparisons):
    """The z each of `comparisons` two-sided tests must pass so that all of them together raise
    a false alarm as often as one test at `standard_errors` does (Bonferroni): 3 and 1 -> 3."""
    tail = 2 * (1 - NormalDist().cdf(standard_errors))
    return NormalDist().inv_cdf(1 - tail / (2 * max(comparisons, 1)))
