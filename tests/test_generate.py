"""generate_responses: the target's own answers, with the exact token ids, from prompts read strictly."""

import json

import pytest

from eaglenest.data.prompts import read_prompts
from eaglenest.data.generate import response_record, split_completion
from eaglenest.data.records import parse_record
from eaglenest.data.samples import prompt_id_of
from eaglenest.data.tokenize import tokenize_record
from eaglenest.workflow.errors import InputError
from eaglenest.data.tokenizer import Tokenizer

from kimi_tokenizer import kimi_tokenizer_dir  # noqa: F401 (a fixture)

THINK_END, EOT = 6, 0


@pytest.mark.parametrize("ids, thinking, reasoning, content, closed", [
    ([1, 2, THINK_END, 3, EOT], True, [1, 2], [3], True),         # finished
    ([1, 2, THINK_END, 3], True, [1, 2], [3], True),              # cut while answering
    ([1, 2], True, [1, 2], [], False),                            # cut while thinking
    ([1, 2, EOT], True, [1, 2], [], False),                       # stopped without closing the think block
    ([1, 2, THINK_END, EOT], True, [1, 2], [], True),             # closed it, then said nothing
    ([THINK_END, 3, EOT], True, [], [3], True),                   # empty reasoning
    ([3, THINK_END, 4, EOT], False, [], [3, THINK_END, 4], False),  # no think block opened: all content
])
def test_split_completion(ids, thinking, reasoning, content, closed):
    assert split_completion(ids, thinking=thinking, think_end=THINK_END, end_of_turn=EOT) == (reasoning, content, closed)


@pytest.fixture(scope="module", params=["demo", "kimi"])
def tokenizer(request):
    """The demo target's fast tokenizer, and a Kimi-style remote-code one."""
    target = request.getfixturevalue("demo_target" if request.param == "demo" else "kimi_tokenizer_dir")
    return Tokenizer(target, trust_remote_code=request.param == "kimi", think_start="<think>", think_end="</think>",
                     end_of_turn="<|im_end|>", chat_template_kwargs={"thinking": True})


@pytest.mark.parametrize("reasoning, content, closed, finish", [
    ("12 + 30 = 42.", "42", True, "stop"),
    ("Still thinking when it said <|im_end|>", None, False, "stop"),  # <|im_end|> inside its reasoning
    ("Cut off while thinking", None, False, "length"),
    ("Closed the block, then said nothing.", "", True, "stop"),
])
def test_records_keep_what_the_model_emitted(tokenizer, reasoning, content, closed, finish):
    """A record's text fields say what its ids say, and re-tokenizing the record without its ids gives
    back the same completion: never a </think> the model did not emit."""
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    prompt = tokenizer.prompt(messages)
    completion = tokenizer.text(reasoning)
    completion += [] if content is None else [tokenizer.think_end] + tokenizer.text(content)
    completion += [tokenizer.end_of_turn] if finish == "stop" else []
    record = response_record("x", messages, prompt, completion, finish, tokenizer, temperature=0)
    assert (record["reasoning_content"], record["content"]) == (reasoning, content or "")
    assert record["temperature"] == 0.0 and isinstance(record["temperature"], float)
    assert record["reasoning_closed"] is closed
    without_ids = {k: v for k, v in record.items() if not k.endswith("_token_ids")}
    assert tokenize_record(parse_record(without_ids, "raw.jsonl:1"), tokenizer)[0] == prompt + completion


@pytest.fixture(scope="module", params=["thinking off", "no reasoning block"])
def plain_tokenizer(request, demo_target):
    """Prompts that open no think block: a reasoning target with thinking turned off, and one
    configured as a target without a reasoning block (think tokens null)."""
    tokens = ({"think_start": "<think>", "think_end": "</think>"} if request.param == "thinking off"
              else {"think_start": None, "think_end": None})
    return Tokenizer(demo_target, trust_remote_code=False, end_of_turn="<|im_end|>",
                     chat_template_kwargs={"thinking": False}, **tokens)


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_records_without_a_think_block_carry_no_reasoning_and_tokenize(plain_tokenizer, finish):
    """generate_part's records for a prompt that opens no think block are ones tokenize accepts, with
    their ids and rebuilt from their text alike (the stream a template without think tokens emits)."""
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    prompt = plain_tokenizer.prompt(messages)
    assert not plain_tokenizer.thinking(prompt)
    completion = plain_tokenizer.text("The answer is 42.") + ([plain_tokenizer.end_of_turn] if finish == "stop" else [])
    record = response_record("x", messages, prompt, completion, finish, plain_tokenizer, temperature=1.0)
    assert "reasoning_content" not in record and "reasoning_closed" not in record
    assert record["content"] == "The answer is 42."
    without_ids = {k: v for k, v in record.items() if not k.endswith("_token_ids")}
    for fields in (record, without_ids):
        ids, mask = tokenize_record(parse_record(json.loads(json.dumps(fields)), "raw.jsonl:1"), plain_tokenizer)
        assert ids == prompt + completion and mask == [0] * len(prompt) + [1] * len(completion)


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "messages": []}', r"p\.jsonl:2: field 'messages': empty"),
    ('{"id": "a", "messages": [{"role": "assistant", "content": "x"}]}', r"p\.jsonl:2: field 'messages\[0\]\.role': the prompt must end with a user or tool message"),
    ('{"messages": [{"role": "user", "content": "x"}]}', r"p\.jsonl:2: field 'id': missing"),
    ('{"id": "p1", "messages": [{"role": "user", "content": "x"}]}', r"p\.jsonl:2: field 'id': duplicate id 'p1' \(first on line 1\)"),
    ('{"id": "b", ', r"p\.jsonl:2: malformed JSON"),
])
def test_bad_prompts_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "p1", "messages": [{"role": "user", "content": "What is 2 + 2?"}]}\n' + line + "\n")
    with pytest.raises(InputError, match=message):
        read_prompts(path)


def test_the_built_run_learns_from_exactly_what_the_target_emitted(built):
    """The demo's generate.temperatures is null: each prompt answered at eval.temperatures, 0 and 1.0."""
    results = built / "results"
    records = [json.loads(line) for line in (results / "responses/raw_responses.jsonl").read_text().splitlines()]
    samples = {s["id"]: s for s in map(json.loads, (results / "data/tokenized_data.jsonl").read_text().splitlines())}
    tokenizer = Tokenizer(results / "target", trust_remote_code=False, think_start="<think>", think_end="</think>", end_of_turn="<|im_end|>",
                          chat_template_kwargs={"thinking": True})
    prompts = {p[0]: p[1] for p in read_prompts(built / "resources/demo/prompts.jsonl")}
    assert [(r["id"], r["temperature"]) for r in records] == [(f"{p}#{j}", t) for p in prompts
                                                               for j, t in enumerate([0.0, 1.0])]
    for record in records:
        assert record["messages"] == prompts[prompt_id_of(record["id"])]
        assert record["prompt_token_ids"] == tokenizer.prompt(record["messages"], record.get("tools"))
        completion = record["completion_token_ids"]
        assert (completion[-1] == tokenizer.end_of_turn) == (record["finish_reason"] == "stop")
        assert tokenizer.end_of_turn not in completion[:-1]  # it stopped where the model ended its turn
        assert record["reasoning_closed"] == (tokenizer.think_end in completion)
        sample = samples[record["id"]]
        assert sample["input_ids"] == record["prompt_token_ids"] + completion
        assert sample["loss_mask"] == [0] * len(record["prompt_token_ids"]) + [1] * len(completion)
        # the text fields are the decoded halves; cut off (or stopped) inside its reasoning, it is all reasoning
        reasoning, _, content = tokenizer.hf.decode(completion).removesuffix("<|im_end|>").partition("</think>")
        assert (reasoning, content) == (record["reasoning_content"], record["content"])
    endings = {(r["reasoning_closed"], r["finish_reason"]) for r in records}
    assert {(True, "stop"), (False, "length")} <= endings  # both kinds of record were checked
