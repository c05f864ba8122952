"""The offline expected acceptance at a temperature (eaglenest.evaluate.expected) against a
simulation of vLLM's rejection sampler on a Markov-chain target, for greedy and probabilistic
drafting, and its arithmetic by hand."""

import math
import random

import pytest
import torch

from eaglenest.evaluate.acceptance import draft_anchors, served_positions
from eaglenest.evaluate.expected import (estimate, family_z, greedy_terms, ratio_standard_error, replay, sample_counts,
                                         sample_seed, sampled_terms)

V, K = 6, 2


def chain(seed):
    """A Markov-chain 'target' (row a: the distribution of the token after a) and a 'drafter'
    guessing the token after a as draft[a] (its mode for some rows, not for others)."""
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(V, V, generator=g) * 2, -1)
    draft = P.argmax(-1)
    draft[::3] = (draft[::3] + 1) % V  # every third guess is not the mode
    return P, draft


def sample(rng, row):
    return rng.choices(range(V), weights=row.tolist())[0]


def served_run(rng, P, draft, start, max_tokens):
    """One request as vLLM serves it with K greedy drafts: accept draft d w.p. P[context][d], on
    rejection emit a sample of P[context] without d, a bonus token when all K are accepted.
    -> (drafts, accepted per position), drafts verified past max_tokens counted as vLLM does."""
    text, drafts, accepted = [start], 0, [0] * K
    while len(text) - 1 < max_tokens:
        drafts += 1
        context, guesses = text[-1], []
        for _ in range(K):
            guesses.append(int(draft[context]))
            context = guesses[-1]
        context = text[-1]
        for k, d in enumerate(guesses):
            if rng.random() < P[context][d]:
                accepted[k] += 1
                text.append(d)
                context = d
            else:
                rest = P[context].clone()
                rest[d] = 0
                text.append(sample(rng, rest))
                break
        else:
            text.append(sample(rng, P[context]))
    return drafts, accepted


def sampled_text(rng, P, start, max_tokens):
    """A text sampled from the target with K tokens past max_tokens (as vllm_baseline generates it):
    (ids, generated)."""
    text = [start]
    while len(text) - 1 < max_tokens + K:
        text.append(sample(rng, P[text[-1]]))
    return torch.tensor(text), torch.arange(len(text)) > 0


def offline_counts(rng, P, draft, start, max_tokens):
    """The same request replayed offline: the drafts of greedy_terms() on a sampled text and
    their target probabilities, through replay()."""
    ids, generated = sampled_text(rng, P, start, max_tokens)
    drafts, context = [], ids.clone()
    for _ in range(K):
        context = draft[context]
        drafts.append(torch.roll(context, -1))  # the guess at anchor t reads x_{t+1}

    def token_probs(tokens):
        return P[ids[:, None], tokens.T].T  # P[x_s][tokens[k, s]]

    return sample_counts(*replay(generated, max_tokens, *greedy_terms(ids, generated, drafts, token_probs)), K)


def served_sampled_run(rng, P, Q, start, max_tokens):
    """One request as vLLM serves it with K probabilistic drafts: each drafted from Q[context]
    (the drafter's distribution after the previous draft), accepted w.p. min(1, P/Q); on rejection
    the emitted token is a sample of (P - Q)+; a bonus token when all K are accepted."""
    text, drafts, accepted = [start], 0, [0] * K
    while len(text) - 1 < max_tokens:
        drafts += 1
        context, guesses = text[-1], []
        for _ in range(K):
            guesses.append(sample(rng, Q[context]))
            context = guesses[-1]
        context = text[-1]
        for k, d in enumerate(guesses):
            if rng.random() < min(1.0, float(P[context][d] / Q[context][d])):
                accepted[k] += 1
                text.append(d)
                context = d
            else:
                text.append(sample(rng, (P[context] - Q[context]).clamp(min=0)))
                break
        else:
            text.append(sample(rng, P[context]))
    return drafts, accepted


def offline_sampled_counts(rng, P, Q, start, max_tokens, seed):
    """The same request replayed offline by sampled_terms(): at anchor t depth k's distribution is
    Q after the text's x_{t+k+1}, the target's P after x_{t+k+1} too (moved back to t inside)."""
    ids, generated = sampled_text(rng, P, start, max_tokens)
    distributions = [Q[torch.roll(ids, -(k + 1))] for k in range(K)]
    p_next = P[ids, torch.roll(ids, -1)]
    terms = sampled_terms(ids, generated, distributions, torch.arange(V), P[ids], p_next)
    return sample_counts(*replay(generated, max_tokens, *terms, seed=seed), K)


def assert_within_3_standard_errors(online, offline):
    """Simulated vLLM counters (drafts, accepted per position) of every request within 3 standard
    errors of the offline expected rate and of its indicator, per position -> their rates."""
    drafts = sum(n for n, _ in online)
    rates = [sum(a[k] for _, a in online) / drafts for k in range(K)]
    for k in range(K):
        se = offline["standard_error_per_position"][k]
        assert 0 < se < 0.05
        assert abs(rates[k] - offline["acceptance_rate_per_position"][k]) <= 3 * se
        assert abs(rates[k] - offline["indicator_rate_per_position"][k]) <= 3 * se
    return rates


def test_the_expected_acceptance_agrees_with_a_simulated_rejection_sampler():
    """vLLM's counters (simulated) within 3 standard errors of the offline expected rate, per
    position; the indicator replay too; and a drafter other than the one served does not agree."""
    rng = random.Random(0)
    P, draft = chain(0)
    starts = [rng.randrange(1, V) for _ in range(400)]
    online = [served_run(rng, P, draft, s, 24) for s in starts]
    offline = estimate([offline_counts(rng, P, draft, s, 24) for s in starts], K)
    rates = assert_within_3_standard_errors(online, offline)
    assert offline["num_draft_tokens"] == K * offline["num_drafts"]
    assert offline["mean_acceptance_length"] == pytest.approx(1 + sum(offline["acceptance_rate_per_position"]))

    other = draft.clone()
    other[1::2] = (other[1::2] + 2) % V  # what a misread drafter would guess
    misread = estimate([offline_counts(rng, P, other, s, 24) for s in starts], K)
    gaps = [abs(rates[k] - misread["acceptance_rate_per_position"][k]) / misread["standard_error_per_position"][k]
            for k in range(K)]
    assert max(gaps) > 3


def test_replay_weighs_the_last_step_by_its_acceptance_and_sample_counts_follow_the_served_anchors():
    """Greedy weights (the drafts equal the text or not) at anchors 0..4: drafts at 0 accept 2 (next
    draft at 3), at 3 accept 0 (next at 4), whose deepest guess, x_7, is past the 7 served tokens:
    not counted, as vLLM's steps past its text are not (acceptance.steps_on_text). The expected
    count weighs depth k by the shallower weights and its own acceptance."""
    generated = torch.ones(8, dtype=torch.bool)
    weights = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float)
    acceptance = torch.tensor([[0.9, 0.8, 0.1, 0.2, 0.3, 0, 0, 0], [0.7, 0.1, 0.1, 0.1, 0.5, 0, 0, 0]])
    anchors, matched, expected = replay(generated, 7, weights, acceptance)
    assert anchors.tolist() == [True] * 5 + [False] * 3  # x_{t+1} served and not the last (x_6)
    assert matched.tolist() == [[True, True] + [False] * 6, [True] + [False] * 7]
    drafts, indicator, expected_counts = sample_counts(anchors, matched, expected, 2)
    assert drafts == 2  # at 0 and 3
    assert indicator == [1, 1]
    # depth 1: its acceptance at every drafted anchor; depth 2: where depth 1 matched the text
    assert expected_counts == pytest.approx([0.9 + 0.2, 0.7])
    assert sample_counts(anchors, matched, None, 2) == (2, [1, 1], [1, 1])
    assert sample_counts(anchors, matched, expected, 1)[0] == 4  # K=1: the draft at 0 accepts 1, next at 2
    # fractional weights: the expected count is their product times the last acceptance, whatever was drawn
    _, _, halves = replay(generated, 7, weights * 0.5, acceptance)
    assert halves[1, 0] == pytest.approx(0.5 * 0.7)


def test_each_sample_draws_its_own_uniforms_so_the_by_prompt_standard_error_sees_their_spread():
    """200 samples of one text and length, each weight 1/2: with draws of their own (sample_seed of
    each id) samples match as chance has it, the indicator's rate is 1/2 within its noise, and its
    by-prompt standard error is the binomial one. Samples sharing one stream would all match alike,
    and the same standard error would be 0."""
    generated, weights = torch.ones(12, dtype=torch.bool), torch.full((1, 12), 0.5)
    matched = [replay(generated, 12, weights, weights, seed=sample_seed(f"heldout/1/p{i}"))[1][0] for i in range(200)]
    assert len({tuple(m.tolist()) for m in matched}) > 150  # of 4,096 patterns: a few alike by chance, not all
    accepted = [float(m.sum()) for m in matched]
    assert sum(accepted) / (12 * 200) == pytest.approx(0.5, abs=0.04)  # 4 binomial standard errors
    assert ratio_standard_error(accepted, [12] * 200) == pytest.approx(math.sqrt(0.25 / (12 * 200)), rel=0.2)
    assert sample_seed("heldout/1/p0") == sample_seed("heldout/1/p0") != sample_seed("heldout/1/p1")


def test_the_probabilistic_estimate_agrees_with_a_simulated_rejection_sampler_and_beats_greedy():
    """Probabilistic drafting (draft ~ q, accepted w.p. min(1, p/q), resampled from (p - q)+)
    simulated as vLLM runs it: its counters within 3 standard errors of sampled_terms()' expected
    rate and of its indicator, per position; a q nearer p accepts more than greedy drafting of the
    same drafter's argmax, and its position 1 passes greedy's ceiling, E[max p]."""
    rng = random.Random(1)
    P, _ = chain(1)
    Q = torch.softmax(torch.log(P) + 0.6 * torch.randn(V, V, generator=torch.Generator().manual_seed(5)), -1)
    starts = [rng.randrange(1, V) for _ in range(400)]
    online = [served_sampled_run(rng, P, Q, s, 24) for s in starts]
    offline = estimate([offline_sampled_counts(rng, P, Q, s, 24, seed) for seed, s in enumerate(starts)], K)
    assert_within_3_standard_errors(online, offline)
    greedy = estimate([offline_counts(rng, P, Q.argmax(-1), s, 24) for s in starts], K)
    assert offline["mean_acceptance_length"] > greedy["mean_acceptance_length"] + 0.1
    assert offline["acceptance_rate_per_position"][0] > P.max(-1).values.mean()


def test_sampled_terms_by_hand():
    """One anchor, K=1, a draft vocab of ids {0, 1} of V=3: acceptance sum min(p, q) over the draft
    vocab; the weight of the text's token min(1, q/p), 0 for a token outside the draft vocab."""
    ids = torch.tensor([2, 0, 1, 2])
    generated = torch.tensor([False, True, True, True])
    targets = torch.tensor([0, 1])
    p_draft = torch.tensor([[0.5, 0.3], [0.2, 0.2], [0.6, 0.1], [0.1, 0.1]])  # p_T(0), p_T(1) after position s
    p_next = torch.tensor([0.5, 0.2, 0.2, 0.0])  # p_T(x_{s+1}) after s: x_1 = 0, x_2 = 1, x_3 = 2
    q = torch.tensor([[0.9, 0.1], [0.25, 0.75], [0.5, 0.5], [0.5, 0.5]])  # at anchor t, guessing x_{t+2}
    weights, acceptance = sampled_terms(ids, generated, [q], targets, p_draft, p_next)
    # anchor 0 guesses x_2 = 1 from position 1: min(0.2, 0.9) + min(0.2, 0.1) = 0.3; weight min(1, 0.1 / 0.2)
    # anchor 1 guesses x_3 = 2 (outside the draft vocab) from position 2: min(0.6, 0.25) + min(0.1, 0.75); weight 0
    assert acceptance[0].tolist() == pytest.approx([0.3, 0.35, 0.0, 0.0])
    assert weights[0].tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])


def test_standard_errors_are_by_prompt_and_the_family_z_grows_with_the_comparisons():
    # two prompts: 3 of 4 and 1 of 4 accepted; rate 1/2
    assert ratio_standard_error([3, 1], [4, 4]) == pytest.approx(math.sqrt(2 * (1 + 1)) / 8)
    assert ratio_standard_error([1], [4]) == math.inf  # one prompt: no spread to measure
    assert family_z(3, 1) == pytest.approx(3)
    assert family_z(3, 24) == pytest.approx(3.86, abs=0.01)


def test_the_sampled_tolerance_takes_vllms_own_spread_by_prompt_where_it_kept_each_requests_counts():
    """Answers that fall into loops carry most deep accepts: vLLM's own sample spreads by prompt as
    the replay's sample does not, and the gap's standard error takes vLLM's where it is known."""
    from eaglenest.evaluate.agreement import tolerance
    offline = {"acceptance_rate_per_position": [0.5, 0.1], "standard_error_per_position": [0.01, 0.002],
               "indicator_standard_error_per_position": [0.006, 0.0017],
               "expected_standard_error_per_position": [0.008, 0.001]}
    online = {"num_drafts": 400, "acceptance_rate_per_position": [0.5, 0.1]}
    per_request = {"drafts": [100, 100, 100, 100], "accepted_per_position": [[50, 40], [50, 0], [50, 0], [50, 0]]}
    own = ratio_standard_error([40, 0, 0, 0], [100] * 4)
    assert own == pytest.approx(0.1)  # one looping answer: all of position 2's accepts
    assert tolerance(offline, 1.0, online, agreement_tolerance=0.05, z=3)[1] == pytest.approx(
        3 * math.sqrt(0.1 * 0.9 / 400))  # without them: the binomial floor over the indicator's 0.002
    assert tolerance(offline, 1.0, online, agreement_tolerance=0.05, z=3, per_request=per_request) == pytest.approx(
        [3 * math.sqrt(0.5 * 0.5 / 400), 3 * math.hypot(own, 0.001)])
    none = {"drafts": [20, 20], "accepted_per_position": [[0, 0], [0, 0]]}  # a few drafts, none accepted
    assert tolerance(offline, 1.0, {"num_drafts": 40, "acceptance_rate_per_position": [0.0, 0.0]},
                     agreement_tolerance=0.05, z=3, per_request=none) == pytest.approx(
        [3 * math.hypot(0.006, 0.008), 3 * math.hypot(0.0017, 0.001)])  # the replay's law, not vLLM's zero spread


def test_rounding_decides_the_drafts_whose_outcome_through_a_depth_the_float32_replay_does_not_share():
    """At temperature 0 in bfloat16 the replay counts, at each depth, the served drafts whose accepted
    tokens through it differ from the float32 replay's: vLLM, rounding with kernels of its own, may
    decide them either way, and the tolerance widens by their share."""
    from eaglenest.evaluate.agreement import tolerance
    from eaglenest.evaluate.expected import rounding_decided
    generated = torch.tensor([False] * 2 + [True] * 10)
    anchors = draft_anchors(generated[None])[0]  # anchors 1 .. 9
    lengths = torch.zeros(12, dtype=torch.long)
    lengths[[1, 3, 6, 8]] = torch.tensor([1, 2, 1, 3])  # served walk: 1, 3, 6, 8
    exact_lengths = lengths.clone()
    exact_lengths[[3, 6, 9]] = torch.tensor([1, 3, 2])  # 3 differs from depth 2 on, 6 from depth 2; 9 is not served
    matched = torch.stack([lengths > k for k in range(3)])
    exact = torch.stack([exact_lengths > k for k in range(3)])
    assert served_positions(anchors.tolist(), lengths.tolist()) == [1, 3, 6, 8]
    assert rounding_decided((anchors, matched, None), exact, 3) == [0, 2, 2]
    assert rounding_decided((anchors, matched, None), matched, 3) == [0, 0, 0]  # float32 against itself
    offline = {"acceptance_rate_per_position": [0.8, 0.5, 0.2], "rounding_decided_per_position": [0.0, 0.5, 0.5]}
    assert tolerance(offline, 0.0, None, agreement_tolerance=0.05, z=3) == [0.05, 0.55, 0.55]
