"""Answer ids and the held-out split by prompt (docs/TOKENIZATION.md, "Answer ids"): every answer of
a prompt is on the side of its prompt, and the heldout suite asks each held-out prompt once."""

import json

import pytest

from eaglenest.data.generate import answers
from eaglenest.data.samples import is_heldout, prompt_id_of
from eaglenest.evaluate.suites import heldout_prompts


@pytest.mark.parametrize("sample_id, prompt_id", [
    ("p", "p"), ("p#0", "p"), ("p#12", "p"), ("a#b#3", "a#b"),  # the text before the last '#' ...
    ("p#", "p#"), ("p#x", "p#x"), ("p#1x", "p#1x"), ("p#-1", "p#-1"), ("p#²", "p#²"), ("#3", ""),  # ... when digits follow
])
def test_prompt_id_of(sample_id, prompt_id):
    assert prompt_id_of(sample_id) == prompt_id


def test_answer_ids_lead_back_to_their_prompt():
    assert answers("q", [0.0, 1.0], 2) == [("q#0", 0.0), ("q#1", 1.0), ("q#2", 1.0)]  # greedy once
    assert answers("q", [0.7], 1) == [("q", 0.7)] and answers("q", [0], 5) == [("q", 0.0)]  # one answer: the prompt's id
    assert answers("q", [1.0, 0.0], 2) == [("q#0", 1.0), ("q#1", 1.0), ("q#2", 0.0)]  # the listed order
    for prompt_id in ("q", "q#7", "a#b"):
        assert {prompt_id_of(answer_id) for answer_id, _ in answers(prompt_id, [0.0, 0.5, 1.0], 3)} == {prompt_id}


def test_the_answers_of_a_prompt_are_held_out_together():
    prompts = [f"prompt-{i:05d}" for i in range(2000)]
    for fraction in (0.1, 0.5):
        assert all(is_heldout(p, fraction) == is_heldout(f"{p}#0", fraction) == is_heldout(f"{p}#1", fraction)
                   for p in prompts)
    samples = [answer_id for p in prompts for answer_id, _ in answers(p, [0.0, 1.0], 3)]
    sides = {}
    for sample_id in samples:
        sides.setdefault(prompt_id_of(sample_id), set()).add(is_heldout(sample_id, 0.1))
    assert len(sides) == len(prompts) and all(len(side) == 1 for side in sides.values())  # no prompt on both sides
    assert 120 < sum(side == {True} for side in sides.values()) < 280


def test_the_heldout_suite_asks_each_heldout_prompt_once(tmp_path):
    prompts = [f"prompt-{i:05d}" for i in range(100)]
    heldout = [p for p in prompts if is_heldout(p, 0.2)]
    path = tmp_path / "tokenized_data.jsonl"
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            for j, (answer_id, _) in enumerate(answers(p, [0.0, 1.0], 2)):
                f.write(json.dumps({"id": answer_id, "input_ids": [i, i, 100 + j], "loss_mask": [0, 0, 1]}) + "\n")
    entries = heldout_prompts(path, 0.2, max_prompts=1000)
    assert [e["id"] for e in entries] == heldout  # by prompt id, once each, in file order
    assert all(e["prompt_token_ids"] == [int(e["id"][-5:])] * 2 for e in entries)
    assert entries[0]["where"] == f"{path}:{3 * prompts.index(heldout[0]) + 1}"  # the prompt's first answer
    assert [e["id"] for e in heldout_prompts(path, 0.2, max_prompts=3)] == heldout[:3]
