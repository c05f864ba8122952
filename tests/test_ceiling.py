"""The ceiling (eaglenest.evaluate.expected.ceiling_outcomes): the acceptance of an oracle that
drafts the target's own argmax. A real tiny Llama checkpoint whose head is built so that, from the
final state of token a, the target's argmax is (a + 1) mod V with probability q = e^L / (e^L + V - 1)
at temperature 1: at depth k the oracle is accepted with q^k, in closed form; at temperature 0, on
greedy text, always."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglenest.drafter.target_head import TargetHead
from eaglenest.evaluate.acceptance import (acceptance, chain_lengths, oracle_drafts, served_anchors, served_positions,
                                           share_of_ceiling)
from eaglenest.evaluate.expected import ceiling_outcomes, estimate, greedy_terms, replay, sample_counts

V, L, K = 16, 2.0, 3
Q = math.exp(L) / (math.exp(L) + V - 1)  # the target's top probability after every token, at temperature 1


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """The target head whose final norm maps token a's state e_a to sqrt(V) e_a, and whose
    lm_head gives logit L to (a + 1) mod V and 0 to every other token."""
    config = LlamaConfig(vocab_size=V, hidden_size=V, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=V, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.0)
        successor = torch.zeros(V, V)
        successor[(torch.arange(V) + 1) % V, torch.arange(V)] = L / math.sqrt(V)
        model.lm_head.weight.copy_(successor)
    path = tmp_path_factory.mktemp("cyclic") / "target"
    model.save_pretrained(path)
    return TargetHead(path)


def sample_text(ids, generated, final):
    return {"input_ids": ids, "loss_mask": generated.long(), "final_hidden_states": final}


def text(tokens, prompt=2):
    """A sample of `tokens` whose first `prompt` are the prompt; final state of x_s: e_{x_s}."""
    ids = torch.tensor(tokens)
    generated = torch.arange(len(ids)) >= prompt
    return sample_text(ids, generated, torch.eye(V)[ids])


def test_the_head_is_the_cyclic_target(head):
    final = torch.eye(V)
    assert head.argmax(final).tolist() == [(a + 1) % V for a in range(V)]
    successors = torch.tensor([[(a + 1) % V for a in range(V)]])
    assert head.token_probs(final, successors, 1.0) == pytest.approx(torch.full((1, V), Q), abs=1e-4)  # but for the norm's eps


def test_the_ceiling_is_1_at_temperature_0_on_greedy_text(head):
    """Greedy text: the oracle matches at every anchor whose depth is still inside the text, as
    a drafter that drafts the text itself does; at K = 1 that is every anchor."""
    samples = [text([(start + i) % V for i in range(length)]) for start, length in [(0, 40), (5, 23), (9, 64)]]
    for K_ in (1, K):
        oracle, copy = [], []
        for s in samples:
            oracle.append(sample_counts(*ceiling_outcomes(s, int(s["loss_mask"].sum()), K_, head=head, temperature=0.0),
                                        K_))
            ids = s["input_ids"]
            itself = [torch.roll(ids, -(k + 2)) for k in range(K_)]  # x_{t+k+2}: the text's own next tokens
            generated = s["loss_mask"].bool()
            copy.append(sample_counts(*replay(generated, int(generated.sum()), *greedy_terms(ids, generated, itself)),
                                      K_))
        assert estimate(oracle, K_)["acceptance_rate_per_position"] == estimate(copy, K_)["acceptance_rate_per_position"]
    assert estimate([sample_counts(*ceiling_outcomes(s, 10**6, 1, head=head, temperature=0.0), 1) for s in samples],
                    1)["acceptance_rate_per_position"] == [1.0]
    # the offline evaluation's path (chain_lengths at temperature 0) counts the same
    batch = {"input_ids": samples[0]["input_ids"][None], "loss_mask": samples[0]["loss_mask"][None]}
    anchors, lengths = chain_lengths(oracle_drafts(head.argmax(samples[0]["final_hidden_states"])[None], 1), batch)
    assert acceptance(served_anchors(anchors[0].tolist(), lengths[0].tolist()), 1)["acceptance_rate_per_position"] == [1.0]


def test_the_ceiling_at_temperature_1_is_q_to_the_k(head):
    """Texts sampled from the target at temperature 1: the oracle's depth-k acceptance is q^k,
    within 4 of the estimate's standard errors."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(head.norm(torch.eye(V)) @ head.lm_head.T, -1)  # row a: p(next | a)
    counts = []
    for _ in range(60):
        tokens = [int(torch.randint(V, (1,), generator=g)), 0]
        tokens[1] = int(torch.multinomial(probs[tokens[0]], 1, generator=g))
        for _ in range(120):
            tokens.append(int(torch.multinomial(probs[tokens[-1]], 1, generator=g)))
        s = text(tokens)
        counts.append(sample_counts(*ceiling_outcomes(s, 10**6, K, head=head, temperature=1.0), K))
    got = estimate(counts, K)
    for k in range(K):
        assert abs(got["acceptance_rate_per_position"][k] - Q ** (k + 1)) <= 4 * got["standard_error_per_position"][k]
    assert max(got["standard_error_per_position"]) < 0.03  # the test can fail: the estimate is tight


def test_share_of_ceiling_divides_and_leaves_an_empty_ceiling_blank():
    assert share_of_ceiling([0.3, 0.1, 0.0], [0.6, 0.2, 0.0]) == [0.5, 0.5, None]


def test_the_probabilistic_ceiling_is_the_target_mass_on_the_draft_vocab(head):
    """Probabilistic drafting's ceiling (the oracle drafting from p_T restricted to the draft vocab):
    with every id in the draft vocab it accepts every draft whatever the temperature; with the even
    ids only, depth 1 is p_T's mass on them, averaged over the drafted anchors, and the ceiling
    stays above greedy's (max p_T) wherever the argmax is a draft token."""
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(head.norm(torch.eye(V)) @ head.lm_head.T, -1)
    tokens = [0]
    for _ in range(200):
        tokens.append(int(torch.multinomial(probs[tokens[-1]], 1, generator=g)))
    s = text(tokens)
    served = int(s["loss_mask"].sum()) - K  # the text runs K tokens past the served ones, as the baseline's does
    every = ceiling_outcomes(s, served, K, head=head, temperature=1.0, method="probabilistic", targets=torch.arange(V))
    assert estimate([sample_counts(*every, K)], K)["acceptance_rate_per_position"] == pytest.approx([1.0] * K)
    even = torch.arange(0, V, 2)
    drafts, _, expected = sample_counts(*ceiling_outcomes(s, served, 1, head=head, temperature=1.0,
                                                          method="probabilistic", targets=even), 1)
    anchors, matched, _ = ceiling_outcomes(s, served, 1, head=head, temperature=1.0, method="probabilistic",
                                           targets=even)
    drafted = torch.tensor(served_positions(anchors.tolist(), matched[:1].sum(0).tolist()))
    ids = torch.tensor(tokens)
    mass = probs[:, even].sum(-1)  # p_T's mass on the draft vocab after token a
    assert expected[0] == pytest.approx(float(mass[ids[drafted + 1]].sum()), rel=1e-5)  # depth 1 reads after x_{t+1}
    # where the argmax is a draft token (after an odd token) the mass holds it: above greedy's max p_T there
    assert bool((mass[1::2] > probs[1::2].max(-1).values).all())
