"""Faithful tokenization on the real demo tokenizer: the stream the model saw and emitted."""

import json

import pytest

from eaglenest.data.records import Record, read_records
from eaglenest.workflow.errors import InputError
from eaglenest.data.tokenizer import Tokenizer
from eaglenest.data.tokenize import tokenize_file, tokenize_record
from eaglenest.data.samples import read_tokenized

from conftest import DEMO_RAW

TOKENS = {"think_start": "<think>", "think_end": "</think>", "end_of_turn": "<|im_end|>"}


@pytest.fixture(scope="module")
def tok(demo_target):
    return Tokenizer(demo_target, trust_remote_code=False, chat_template_kwargs={"thinking": True}, **TOKENS)


def record(**fields):
    base = dict(
        id="x",
        messages=[{"role": "user", "content": "What is 12 + 30?"}],
        reasoning_content="12 + 30 = 42.",
        content="The answer is 42.",
        finish_reason="stop",
        reasoning_closed=None,
        prompt_token_ids=None,
        completion_token_ids=None,
        where="raw.jsonl:1",
    )
    return Record(**(base | fields))


def split(tok, r):
    ids, mask = tokenize_record(r, tok)
    assert len(ids) == len(mask)
    start = mask.index(1)
    assert all(mask[start:]) and not any(mask[:start])
    return ids[:start], ids[start:]


def test_generated_span_decodes_to_exactly_what_the_model_emitted(tok):
    r = record(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcödé × ÷ 🙂?"}])
    prompt, generated = split(tok, r)
    assert prompt[-1] == tok.think_start
    assert tok.hf.decode(prompt).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert tok.hf.decode(generated) == r.reasoning_content + "</think>" + r.content + "<|im_end|>"
    assert generated.count(tok.think_end) == 1 and generated[-1] == tok.end_of_turn


def test_prompt_equals_the_chat_template_rendering(tok):
    messages = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 2 + 2?"},
    ]
    prompt, _ = split(tok, record(messages=messages))
    rendered = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=True)
    assert prompt == tok.hf.encode(rendered, add_special_tokens=False)
    assert "<think></think>2<|im_end|>" in rendered


def test_special_token_text_typed_by_a_user_stays_plain_text(tok):
    typed = "Is <think> a tag? And <|im_end|>?"
    prompt, generated = split(tok, record(messages=[{"role": "user", "content": typed}], content="<think> is text"))
    assert prompt.count(tok.think_start) == 1  # only the generation prompt's
    assert prompt.count(tok.end_of_turn) == 1  # only the end of the user turn
    assert generated.count(tok.think_start) == 0
    assert typed in tok.hf.decode(prompt)


def test_empty_reasoning_and_length_cut_responses(tok):
    _, empty = split(tok, record(reasoning_content=""))
    assert tok.hf.decode(empty) == "</think>The answer is 42.<|im_end|>"
    _, thinking = split(tok, record(content="", finish_reason="length"))
    assert tok.hf.decode(thinking) == "12 + 30 = 42."  # cut while thinking: no </think>
    _, answering = split(tok, record(finish_reason="length"))
    assert tok.hf.decode(answering) == "12 + 30 = 42.</think>The answer is 42."  # no end of turn


@pytest.mark.parametrize("fields, emitted", [
    (dict(content="", reasoning_closed=False), "12 + 30 = 42.<|im_end|>"),  # stopped inside its reasoning
    (dict(content=""), "12 + 30 = 42.<|im_end|>"),  # the record does not say: no </think> is added
    (dict(content="", reasoning_closed=True), "12 + 30 = 42.</think><|im_end|>"),  # closed, then nothing
    (dict(content="", reasoning_closed=True, finish_reason="length"), "12 + 30 = 42.</think>"),
    (dict(content="", reasoning_closed=False, finish_reason="length"), "12 + 30 = 42."),
    (dict(reasoning_closed=True), "12 + 30 = 42.</think>The answer is 42.<|im_end|>"),
])
def test_think_end_only_where_the_model_emitted_it(tok, fields, emitted):
    _, generated = split(tok, record(**fields))
    assert tok.hf.decode(generated) == emitted


def test_records_say_whether_the_think_block_was_closed(tmp_path):
    canonical = {"messages": [{"role": "user", "content": "Think."}], "reasoning_content": "Hmm",
                 "content": "", "finish_reason": "stop"}
    openai = {"id": "c", "messages": canonical["messages"], "reasoning_closed": True, "response": {"id": "x", "choices": [
        {"message": {"content": None, "reasoning_content": "Hmm"}, "finish_reason": "stop"}]}}
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in [
        canonical | {"id": "a", "reasoning_closed": False}, canonical | {"id": "b"}, openai]))
    assert [r.reasoning_closed for r in read_records(raw)] == [False, None, True]
    raw.write_text(json.dumps(canonical | {"id": "a", "content": "Done.", "reasoning_closed": False}) + "\n")
    with pytest.raises(InputError, match=r"raw\.jsonl:1: field 'reasoning_closed': false, but there is content"):
        read_records(raw)


def test_the_demo_tokenizer_keeps_its_ids(tok):
    """Its plain-text route (a copy of the fast backend) gives the ids split_special_tokens=True gave,
    and leaves the tokenizer itself parsing special tokens."""
    assert tok.route == "tokenizers backend"
    texts = ["Is <think> a tag? And <|im_end|>?"]
    for r in read_records(DEMO_RAW):
        texts += [m["content"] for m in r.messages] + [r.reasoning_content, r.content]
    for text in texts:
        assert tok.text(text) == tok.hf.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert tok.hf.encode("<think>", add_special_tokens=False) == [tok.think_start]


def test_token_ids_in_the_record_are_used_verbatim(tok):
    ids, mask = tokenize_record(record(prompt_token_ids=[5, 6, 7], completion_token_ids=[8, 9]), tok)
    assert (ids, mask) == ([5, 6, 7, 8, 9], [0, 0, 0, 1, 1])
    with pytest.raises(InputError, match=r"raw\.jsonl:1: field 'prompt_token_ids'/'completion_token_ids': id 999999"):
        tokenize_record(record(prompt_token_ids=[5], completion_token_ids=[999999]), tok)


def test_reasoning_without_a_think_prompt_is_rejected(demo_target):
    plain = Tokenizer(demo_target, trust_remote_code=False, chat_template_kwargs={"thinking": False}, **TOKENS)
    with pytest.raises(InputError, match=r"raw\.jsonl:1: field 'reasoning_content'"):
        tokenize_record(record(), plain)
    with pytest.raises(InputError, match=r"raw\.jsonl:1: field 'reasoning_closed'"):
        tokenize_record(record(reasoning_content="", reasoning_closed=True), plain)
    _, generated = split(plain, record(reasoning_content=""))
    assert plain.hf.decode(generated) == "The answer is 42.<|im_end|>"


@pytest.mark.parametrize("fields, field", [
    ({"reasoning_content": "12 + 30 = 42."}, "reasoning_content"),
    ({"reasoning_content": "", "reasoning_closed": False}, "reasoning_closed"),
    ({"reasoning_content": "x", "prompt_token_ids": [5], "completion_token_ids": [6]}, "reasoning_content"),  # ids too
])
def test_reasoning_for_a_target_without_a_reasoning_block_is_rejected(demo_target, fields, field):
    """A target without think tokens (think_start/think_end null) has no place for reasoning: a record
    that carries some is bad input, named by file, line and field, whether or not it has ids."""
    plain = Tokenizer(demo_target, trust_remote_code=False, chat_template_kwargs={"thinking": False},
                      think_start=None, think_end=None, end_of_turn="<|im_end|>")
    assert not plain.reasons
    with pytest.raises(InputError, match=rf"^raw\.jsonl:1: field '{field}': the record carries reasoning, but the "
                                         r"target has no reasoning block \(tokenize\.think_start and think_end are null\)$"):
        tokenize_record(record(**fields), plain)
    _, generated = split(plain, record(reasoning_content=""))
    assert plain.hf.decode(generated) == "The answer is 42.<|im_end|>"


def run(demo_target, tmp_path, raw=DEMO_RAW, **overrides):
    settings = dict(trust_remote_code=False, max_seq_len=512, overlong="truncate", chat_template_kwargs={"thinking": True}, **TOKENS)
    out, report = tmp_path / "tok.jsonl", tmp_path / "report.json"
    result = tokenize_file(raw, demo_target, out, report, **(settings | overrides))
    return result, list(read_tokenized(out))


def test_demo_file_report_and_overlong_policies(demo_target, tmp_path):
    report, samples = run(demo_target, tmp_path)
    assert report["samples_in"] == 300 == report["samples_out"] == len(samples)
    assert report["truncated"] == 0 and report["rejected"] == {}
    assert report["generated_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    longest = max(len(s["input_ids"]) for s in samples)
    limit = longest - 1
    report, samples = run(demo_target, tmp_path, max_seq_len=limit)
    assert report["truncated"] >= 1 and max(len(s["input_ids"]) for s in samples) == limit
    report, samples = run(demo_target, tmp_path, max_seq_len=limit, overlong="drop")
    assert report["rejected"]["too_long"] == report["samples_in"] - report["samples_out"] >= 1
    with pytest.raises(InputError, match=rf"raw_responses\.jsonl:\d+: sample '.*': {longest} tokens > max_seq_len {limit}"):
        run(demo_target, tmp_path / "x", max_seq_len=limit, overlong="error")
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_bad_input_leaves_no_output(demo_target, tmp_path):
    raw = tmp_path / "raw.jsonl"
    good = DEMO_RAW.read_text().splitlines()[:3]
    raw.write_text("\n".join(good + ['{"id": "z", "messages": []}']) + "\n")
    with pytest.raises(InputError, match=r"raw\.jsonl:4: field 'messages': empty"):
        run(demo_target, tmp_path, raw=raw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.jsonl"]
