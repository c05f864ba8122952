"""The offline expected acceptance at a temperature (eaglenest.evaluate.expected) against a
simulation of vLLM's rejection sampler on a Markov-chain target, and its arithmetic by hand."""

import math
import random

import pytest
import torch

from eaglenest.evaluate.expected import estimate, family_z, ratio_standard_error, replay, sample_counts

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


def offline_counts(rng, P, draft, start, max_tokens):
    """The same request replayed offline: a text sampled from the target with K tokens past
    max_tokens (as vllm_baseline generates it), the drafts of replay() and their target probabilities."""
    text = [start]
    while len(text) - 1 < max_tokens + K:
        text.append(sample(rng, P[text[-1]]))
    ids = torch.tensor(text)
    generated = torch.arange(len(text)) > 0
    drafts, context = [], ids.clone()
    for _ in range(K):
        context = draft[context]
        drafts.append(torch.roll(context, -1))  # the guess at anchor t reads x_{t+1}

    def token_probs(tokens):
        return P[ids[:, None], tokens.T].T  # P[x_s][tokens[k, s]]

    anchors, matched, probs = replay(ids, generated, max_tokens, drafts, token_probs)
    return sample_counts(anchors, matched, probs, K)


def test_the_expected_acceptance_agrees_with_a_simulated_rejection_sampler():
    """vLLM's counters (simulated) within 3 standard errors of the offline expected rate, per
    position; the indicator replay too; and a drafter other than the one served does not agree."""
    rng = random.Random(0)
    P, draft = chain(0)
    starts = [rng.randrange(1, V) for _ in range(400)]
    online = [served_run(rng, P, draft, s, 24) for s in starts]
    offline = estimate([offline_counts(rng, P, draft, s, 24) for s in starts], K)
    drafts = sum(n for n, _ in online)
    rates = [sum(a[k] for _, a in online) / drafts for k in range(K)]
    for k in range(K):
        se = offline["standard_error_per_position"][k]
        assert 0 < se < 0.05
        assert abs(rates[k] - offline["acceptance_rate_per_position"][k]) <= 3 * se
        assert abs(rates[k] - offline["indicator_rate_per_position"][k]) <= 3 * se
    assert offline["num_draft_tokens"] == K * offline["num_drafts"]
    assert offline["mean_acceptance_length"] == pytest.approx(1 + sum(offline["acceptance_rate_per_position"]))

    other = draft.clone()
    other[1::2] = (other[1::2] + 2) % V  # what a misread drafter would guess
    misread = estimate([offline_counts(rng, P, other, s, 24) for s in starts], K)
    gaps = [abs(rates[k] - misread["acceptance_rate_per_position"][k]) / misread["standard_error_per_position"][k]
            for k in range(K)]
    assert max(gaps) > 3


def test_sample_counts_follow_the_served_anchors_and_weigh_the_last_step_by_its_probability():
    """Anchors 0..4; drafts at 0 accept 2 (next draft at 3), at 3 accept 0 (next at 4)."""
    anchors = torch.tensor([True, True, True, True, True, False])
    matched = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.9, 0.8, 0.1, 0.2, 0.3, 0.0], [0.7, 0.1, 0.1, 0.1, 0.5, 0.0]])
    drafts, indicator, expected = sample_counts(anchors, matched, probs, 2)
    assert drafts == 3  # at 0, 3, 4
    assert indicator == [1, 1]
    # depth 1: p at every drafted anchor; depth 2: p where depth 1 matched the text
    assert expected == pytest.approx([0.9 + 0.2 + 0.3, 0.7])
    assert sample_counts(anchors, matched, None, 2) == (3, [1, 1], [1, 1])
    assert sample_counts(anchors, matched, probs, 1)[0] == 4  # K=1: the draft at 0 accepts 1, next at 2


def test_standard_errors_are_by_prompt_and_the_family_z_grows_with_the_comparisons():
    # two prompts: 3 of 4 and 1 of 4 accepted; rate 1/2
    assert ratio_standard_error([3, 1], [4, 4]) == pytest.approx(math.sqrt(2 * (1 + 1)) / 8)
    assert ratio_standard_error([1], [4]) == math.inf  # one prompt: no spread to measure
    assert family_z(3, 1) == pytest.approx(3)
    assert family_z(3, 24) == pytest.approx(3.86, abs=0.01)
