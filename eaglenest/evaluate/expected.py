"""Offline acceptance at any temperature and draft method, and how far vLLM's counters may fairly
be from it.

vLLM's rejection sampler emits tokens that follow p_T, the target's distribution at temperature T,
whatever the drafter drafts. How a draft is accepted depends on SpeculativeConfig.draft_sample_method:

- greedy (the default): the draft is the drafter's argmax d, treated as one-hot: accepted with
  probability p_T(d), and on rejection the emitted token is sampled from p_T with d left out. So
  the draft was accepted iff the emitted token equals it, and no drafter is accepted more often
  than an oracle drafting the target's argmax (max p_T, the greedy ceiling).
- probabilistic: the draft is sampled from the drafter's own q_T = softmax(logits / T) (zero
  outside the draft vocab) and accepted with min(1, p_T(x) / q_T(x)); on rejection the emitted
  token is sampled from (p_T - q_T)+. Acceptance at a position is sum_x min(p_T(x), q_T(x)) =
  1 - TV(p_T, q_T), bounded by p_T's mass on the draft vocab (the probabilistic ceiling: an oracle
  drafting from p_T restricted to the draft vocab).

Both are one law on a text the target sampled at T (the baseline's): draw the emitted token x
from p_T and accept the draft with probability w(x), where w(x) = [x == d] for greedy and
min(1, q_T(x) / p_T(x)) for probabilistic; the pair (accepted, x) then follows vLLM's law exactly.
So on the baseline's text, at each anchor and depth k, replay() takes:

- weights w_k: the probability that depth k is accepted given the text's token there;
- acceptance a_k: the probability that depth k is accepted given the context (depths < k
  accepted, so the context is the text): p_T(d_k) for greedy, sum min(p_T, q_T) for probabilistic.

and gives two estimates:

- indicator: depth k counts as accepted iff a uniform draw falls below w_j at every depth j <= k
  (for greedy drafts: iff they equal the text, exactly as at temperature 0). Each anchor's outcome
  follows the law of vLLM's run, so this is what vLLM would count, on another sample. Each sample
  draws from a stream of its own (sample_seed: a hash of its id), so samples are independent, as
  the standard errors below assume, and a sample draws the same on every run.
- expected (what the comparison uses): w_0 ... w_{k-1} a_k, the indicator's expectation given the
  text, exact at each anchor's last step (a Rao-Blackwellised estimate: the same mean, less variance).

At temperature 0 both are the greedy count of eaglenest.evaluate.acceptance (vLLM drafts the argmax
whatever the method). vLLM drafts at the anchors where the served run had a token to draft from
(served_positions), which depend on the run's own acceptances: the indicator's give them the same law.

Standard errors are by prompt, the drafts of one response being correlated: for a rate
r = sum_i a_i / sum_i n_i over m prompts, SE = sqrt(m / (m - 1) * sum_i (a_i - r n_i)^2) / sum_i n_i.
vLLM's counters are a sample of the indicator's law on the same prompts, so their SE is the
indicator's; a gap is measured in sqrt(SE_indicator^2 + SE_expected^2), or, where vLLM kept each
request's counts, with its own sample's by-prompt SE in place of the indicator's (the agreement
check's tolerance).
"""

import hashlib
import math
from statistics import NormalDist

import torch

from eaglenest.drafter.model import shift_left
from eaglenest.evaluate.acceptance import (acceptance_fields, chain_distributions, chain_drafts, chain_hits, draft_anchors,
                                           oracle_drafts, served_positions)


def shift_right(x, n, fill):
    """x[t - n] at index t of a 1-D tensor, `fill` before the start."""
    out = torch.full_like(x, fill)
    if n < len(x):
        out[n:] = x[: len(x) - n]
    return out


GREEDY, PROBABILISTIC = "greedy", "probabilistic"  # vLLM's draft_sample_method values
CEILINGS = {  # what bounds each method's acceptance on a text, named as vllm_metrics.json names it
    GREEDY: "argmax oracle",  # drafts the target's argmax: accepted with max p_T
    PROBABILISTIC: "draft-vocab oracle",  # drafts from p_T restricted to the draft vocab: accepted with its mass there
}
CEILING_DESCRIPTIONS = {  # vllm_metrics.json's "ceilings": each in a sentence
    GREEDY: "argmax oracle: an oracle drafting the target's own argmax, accepted with max p_T; the most greedy "
              "drafting can be accepted on this text (1 at temperature 0)",
    PROBABILISTIC: "draft-vocab oracle: an oracle drafting from p_T restricted to the draft vocabulary, accepted "
                     "with p_T's mass on the draft vocabulary; the most any drafter with this vocabulary can be "
                     "accepted on this text, as sum min(p_T, q) is",
}


def sample_seed(sample_id):
    """The seed of a sample's uniform draws in replay(): a hash of its id (agreement states'
    "suite/temperature/prompt id"), so no two samples share draws."""
    return int.from_bytes(hashlib.sha256(str(sample_id).encode()).digest()[:8], "little")


def sampled(method, temperature):
    """Whether drafts are sampled (probabilistic drafting above temperature 0) rather than the argmax."""
    return method == PROBABILISTIC and temperature > 0


def _token_probs(sample, head, temperature, device):
    """greedy_terms()' token_probs on one sample: the target's probabilities above temperature 0, else None."""
    if temperature == 0:
        return None
    final = sample["final_hidden_states"].to(head.lm_head.device)
    return lambda tokens: head.token_probs(final, tokens.to(final.device), temperature).to(device)


def _target_probs(sample, head, temperature, targets):
    """sampled_terms()' target side of one sample: (p_T of the draft ids `targets` after each
    position [T, N], p_T of the text's own next token after each position [T])."""
    ids, final = sample["input_ids"], sample["final_hidden_states"].to(head.lm_head.device)
    columns = targets.to(final.device)[:, None].expand(len(targets), len(ids))
    p_draft = head.token_probs(final, columns, temperature).T.to(ids.device)
    p_next = head.token_probs(final, shift_left(ids[None], 1, 0).to(final.device), temperature)[0].to(ids.device)
    return p_draft, p_next


@torch.no_grad()
def chain_outcomes(drafter, sample, served_tokens, K, *, head=None, temperature=0.0, method=GREEDY, seed=0):
    """replay() of the drafter's chain drafts on one sample: input_ids [T], loss_mask [T] (the
    continuation, possibly longer than served), aux_hidden_states [T, 3H] and final_hidden_states
    [T, H]. served_tokens: how many of the continuation's tokens the served run generated; head:
    the target's TargetHead, read above temperature 0; method: vLLM's draft_sample_method; seed:
    the sample's draws (sample_seed)."""
    ids, generated = sample["input_ids"], sample["loss_mask"].bool()
    if sampled(method, temperature):
        q = [d[0] for d in chain_distributions(drafter, ids[None], sample["aux_hidden_states"][None], K, temperature)]
        targets = drafter.draft_to_target(torch.arange(q[0].shape[-1], device=ids.device))
        terms = sampled_terms(ids, generated, q, targets, *_target_probs(sample, head, temperature, targets))
    else:
        drafts = [d[0] for d in chain_drafts(drafter, ids[None], sample["aux_hidden_states"][None], K)]
        terms = greedy_terms(ids, generated, drafts, _token_probs(sample, head, temperature, ids.device))
    return replay(generated, served_tokens, *terms, seed=seed)


@torch.no_grad()
def ceiling_outcomes(sample, served_tokens, K, *, head, temperature, method=GREEDY, targets=None, seed=0):
    """chain_outcomes() of the oracle that bounds `method` on this text, from the sample's
    final_hidden_states through the target's norm and lm_head. Greedy: the oracle drafting the
    target's own argmax (acceptance.oracle_drafts), accepted with max p_T above temperature 0, on
    greedy text always (below 1 there means the states' argmax and the served text disagree:
    numerics). Probabilistic: the oracle whose draft distribution is p_T restricted to the draft
    vocab (target ids `targets`), accepted with p_T's mass there, the most sum min(p_T, q) allows
    any q on the draft vocab. seed: the sample's draws (sample_seed)."""
    ids, generated = sample["input_ids"], sample["loss_mask"].bool()
    if sampled(method, temperature):
        p_draft, p_next = _target_probs(sample, head, temperature, targets)
        oracle = p_draft / p_draft.sum(-1, keepdim=True).clamp_min(torch.finfo(p_draft.dtype).tiny)
        q = [shift_left(oracle[None], k + 1, 0.0)[0] for k in range(K)]  # depth k at anchor t: p_T after t+k+1
        return replay(generated, served_tokens, *sampled_terms(ids, generated, q, targets, p_draft, p_next), seed=seed)
    target_argmax = head.argmax(sample["final_hidden_states"].to(head.lm_head.device)).to(ids.device)
    drafts = [d[0] for d in oracle_drafts(target_argmax[None], K)]
    return replay(generated, served_tokens,
                  *greedy_terms(ids, generated, drafts, _token_probs(sample, head, temperature, ids.device)), seed=seed)


def greedy_terms(ids, generated, drafts, token_probs=None):
    """replay()'s (weights, acceptance) of greedy drafts on a text: weights [K, T], 1 where depth
    k's draft equals the text's token (a generated one); acceptance [K, T], the target's
    probability of depth k's draft (0 where the text ends first), or None at temperature 0.

    ids, generated [T]: the text and which of its tokens the target generated; drafts: K tensors
    [T], depth k's draft at every anchor t (a guess at x_{t+k+2}); token_probs(tokens [K, T]) ->
    [K, T]: the target's probability of tokens[k, s] as the token after position s."""
    weights = chain_hits([d[None] for d in drafts], ids[None], generated[None])[:, 0].float()
    if token_probs is None:
        return weights, None
    # depth k's draft at anchor t is the token after position t+k+1: read there, moved back to t
    at_position = token_probs(torch.stack([shift_right(d, k + 1, 0) for k, d in enumerate(drafts)]))
    acceptance = torch.stack([shift_left(at_position[k][None], k + 1, 0.0)[0] * verifiable(generated, k)
                              for k in range(len(drafts))])
    return weights, acceptance


def sampled_terms(ids, generated, distributions, targets, p_draft, p_next):
    """replay()'s (weights, acceptance) of probabilistic drafts on a text: weights [K, T],
    min(1, q_k(x) / p_T(x)) of the text's token x = x_{t+k+2} (0 outside the draft vocab);
    acceptance [K, T], sum over the draft vocab of min(p_T, q_k) after position t+k+1. Both 0 where
    the text ends first.

    distributions: K tensors [T, N], depth k's draft distribution at anchor t over the draft ids,
    whose target ids are `targets` [N]; p_draft [T, N]: the target's p_T of those ids after
    position s; p_next [T]: p_T of the text's own token x_{s+1} after position s."""
    weights, acceptance = [], []
    for k, q in enumerate(distributions):
        ends = verifiable(generated, k)
        p = shift_left(p_draft[None], k + 1, 0.0)[0]  # p_T of depth k's guess, x_{t+k+2}, moved back to t
        acceptance.append(torch.minimum(p, q).sum(-1) * ends)
        x = shift_left(ids[None], k + 2, -1)[0]
        q_x = (q * (x[:, None] == targets[None, :])).sum(-1)
        p_x = shift_left(p_next[None], k + 1, 0.0)[0]
        ratio = torch.where(p_x > 0, q_x / p_x.clamp_min(torch.finfo(p_x.dtype).tiny), 0.0)
        weights.append(ratio.clamp(max=1.0) * ends)
    return torch.stack(weights), torch.stack(acceptance)


def verifiable(generated, k):
    """[T] bool: at anchor t, depth k's guess x_{t+k+2} is a token the target generated."""
    return shift_left(generated[None], k + 2, False)[0]


def replay(generated, served_tokens, weights, acceptance=None, seed=0):
    """Drafts on a text, as vLLM serves them -> (anchors [T] bool: vLLM drafts after x_{t+1}, a
    served token that is not the served run's last; matched [K, T] bool: the indicator, depth k and
    every shallower one accepted; expected [K, T]: w_0 ... w_{k-1} a_k, or None at temperature 0,
    where matched says it all). Module docstring: weights w and acceptance a (greedy_terms,
    sampled_terms); generated [T]: which of the text's tokens the target generated. The
    indicator's uniform draws come from `seed`, the sample's own (sample_seed; binary weights
    need none: theirs is exact)."""
    served = generated & (generated.cumsum(0) <= served_tokens)
    anchors = draft_anchors(served[None])[0]
    draws = torch.rand(weights.shape, generator=torch.Generator().manual_seed(seed)).to(weights.device)
    matched = (draws < weights).long().cumprod(0).bool()
    if acceptance is None:
        return anchors, matched, None
    reached = torch.cat([torch.ones_like(weights[:1]), weights.cumprod(0)[:-1]])  # depths < k accepted
    return anchors, matched, reached * acceptance


def sample_counts(anchors, matched, expected, K, keep=None):
    """A sample's counts at the anchors vLLM drafts from with K tokens (matched/expected may hold
    more depths) whose K guesses all fall on the served text, as vLLM's counters are compared
    (acceptance.steps_on_text): (drafts, accepted per position by indicator [K], expected accepted
    [K]). The deepest guess from anchor t is x_{t+K+1}, served iff anchor t+K-1 is one. keep [T]
    bool: count only the drafts at its True anchors (vLLM's drafts all the same: those drafting
    into a tool-call span, say, acceptance.drafts_in_span)."""
    matched = matched[:K]
    lengths = matched.sum(0)
    flags = anchors.tolist()
    walk = served_positions(flags, lengths.tolist())
    positions = torch.tensor([t for t in walk if t + K - 1 < len(flags) and flags[t + K - 1]], dtype=torch.long)
    if keep is not None:
        positions = positions[keep.cpu()[positions]]
    indicator = matched[:, positions].sum(1).double()
    if expected is None:
        return len(positions), indicator.tolist(), indicator.tolist()
    return len(positions), indicator.tolist(), expected[:K, positions].sum(1).double().tolist()


def rounding_decided(outcomes, exact_matched, K):
    """Of a sample's drafts (sample_counts' anchors of `outcomes`, the replay in the engine's
    dtype), how many at each depth k < K have an outcome through depth k that the float32 replay
    (`exact_matched`, chain_outcomes' matched) does not share: drafts that the dtype's rounding
    decides, which vLLM, computing in that dtype with kernels of its own, may decide either way."""
    anchors, matched, _ = outcomes
    differs = (matched[:K] != exact_matched[:K]).long().cummax(0).values.bool()  # through depth k
    return [sample_counts(anchors, matched, None, K, keep=differs[k])[0] for k in range(K)]


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
    fields["indicator_standard_error_per_position"] = [ratio_standard_error(indicator[k], drafts) for k in range(K)]
    fields["expected_standard_error_per_position"] = [ratio_standard_error(expected[k], drafts) for k in range(K)]
    fields["standard_error_per_position"] = [
        math.hypot(fields["indicator_standard_error_per_position"][k], fields["expected_standard_error_per_position"][k])
        for k in range(K)]
    return fields


def family_z(standard_errors, comparisons):
    """The z each of `comparisons` two-sided tests must pass so that all of them together raise
    a false alarm as often as one test at `standard_errors` does (Bonferroni): 3 and 1 -> 3."""
    tail = 2 * (1 - NormalDist().cdf(standard_errors))
    return NormalDist().inv_cdf(1 - tail / (2 * max(comparisons, 1)))
