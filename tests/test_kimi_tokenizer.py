"""Kimi-K2.5's kind of tokenizer, built locally (tests/kimi_tokenizer.py): remote code over tiktoken
whose own encode parses special-token text on every documented path. Typed special-token text must
still stay text, in the Tokenizer, in the stages and in a real Snakemake run."""

import itertools
import json

import pytest
from transformers import AutoTokenizer

from eaglenest.data.generate import generate_part
from eaglenest.data.records import Record
from eaglenest.data.tokenize import tokenize_file, tokenize_record
from eaglenest.data.tokenizer import Tokenizer
from eaglenest.workflow.errors import InputError

from conftest import edit_config, new_workdir, snakemake
from kimi_tokenizer import IM_TOKENS, build_kimi_tokenizer, kimi_tokenizer_dir  # noqa: F401 (a fixture)

TOKENS = {"think_start": "<think>", "think_end": "</think>", "end_of_turn": "<|im_end|>"}
TYPED = "Typed: <think>, </think> and <|im_end|>."


def kimi_tokenizer(target_dir, **overrides):
    settings = dict(trust_remote_code=True, chat_template_kwargs={"thinking": True}, **TOKENS)
    return Tokenizer(target_dir, **(settings | overrides))


@pytest.fixture(scope="module")
def kimi(kimi_tokenizer_dir):  # noqa: F811 (the fixture imported above)
    return kimi_tokenizer(kimi_tokenizer_dir)


def test_it_loads_only_as_remote_code(kimi_tokenizer_dir):  # noqa: F811
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoTokenizer.from_pretrained(kimi_tokenizer_dir, trust_remote_code=False)
    with pytest.raises(InputError, match=r"tokenizer_config\.json: field 'auto_map': .* target\.trust_remote_code: true"):
        kimi_tokenizer(kimi_tokenizer_dir, trust_remote_code=False)
    hf = AutoTokenizer.from_pretrained(kimi_tokenizer_dir, trust_remote_code=True)
    assert type(hf).__name__ == "TikTokenTokenizer" and not hf.is_fast
    base = hf.model.n_vocab - 256  # the reserved special ids come right after the base vocabulary
    assert [hf.convert_tokens_to_ids(t) for t in IM_TOKENS] == [base + k for k in (2, 3, 4, 10, 17, 22, 23)]


def test_its_own_encode_parses_special_tokens_even_when_told_not_to(kimi):
    hf, think = kimi.hf, kimi.think_start
    assert think in hf.encode("a <think> b", add_special_tokens=False, split_special_tokens=True)
    assert think in hf.encode("a <think> b")
    assert think not in hf.encode("a <think> b", allow_special_tokens=False)
    assert kimi.route == "tiktoken Encoding"


def spans(kimi, ids):
    """The ids as text: each special id by its name, each run of other ids decoded."""
    special = kimi.hf.added_tokens_decoder
    out = []
    for is_special, run in itertools.groupby(ids, key=lambda i: i in special):
        run = list(run)
        out += [special[i].content for i in run] if is_special else [kimi.hf.decode(run)]
    return out


@pytest.mark.parametrize("where", ["system", "user", "reasoning", "content"])
def test_typed_special_tokens_stay_characters(kimi, where):
    texts = {"system": "Be brief.", "user": "What is 12 + 30?", "reasoning": "12 + 30 = 42.", "content": "42"}
    texts[where] += " " + TYPED
    record = Record(id="x", messages=[{"role": "system", "content": texts["system"]},
                                      {"role": "user", "content": texts["user"]}],
                    reasoning_content=texts["reasoning"], content=texts["content"], finish_reason="stop",
                    reasoning_closed=None, prompt_token_ids=None, completion_token_ids=None, where="raw.jsonl:1")
    ids, _ = tokenize_record(record, kimi)
    assert spans(kimi, ids) == [
        "<|im_system|>", "system", "<|im_middle|>", texts["system"], "<|im_end|>",
        "<|im_user|>", "user", "<|im_middle|>", texts["user"], "<|im_end|>",
        "<|im_assistant|>", "assistant", "<|im_middle|>", "<think>",
        texts["reasoning"], "</think>", texts["content"], "<|im_end|>"]


def test_special_ids_come_from_the_vocabulary(kimi_tokenizer_dir):  # noqa: F811
    with pytest.raises(InputError, match=r"tokenizer TikTokenTokenizer: '<nope>' is not one token of its vocabulary"):
        kimi_tokenizer(kimi_tokenizer_dir, think_start="<nope>")


RAW = [  # (record, what the model emitted after the prompt)
    ({"id": "plain", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
      "reasoning_content": "2 + 2 = 4.", "content": "4", "finish_reason": "stop"},
     ["2 + 2 = 4.", "</think>", "4", "<|im_end|>"]),
    ({"id": "typed-user", "messages": [{"role": "user", "content": "Is <think> a tag? " + TYPED}],
      "reasoning_content": "It is text.", "content": "Text.", "finish_reason": "stop"},
     ["It is text.", "</think>", "Text.", "<|im_end|>"]),
    ({"id": "typed-answer", "messages": [{"role": "user", "content": "Quote the tags."}],
      "reasoning_content": "Quote " + TYPED, "content": "Here: " + TYPED, "finish_reason": "stop"},
     ["Quote " + TYPED, "</think>", "Here: " + TYPED, "<|im_end|>"]),
    ({"id": "stopped-thinking", "messages": [{"role": "user", "content": "Think."}],
      "reasoning_content": "Still thinking", "content": "", "reasoning_closed": False, "finish_reason": "stop"},
     ["Still thinking", "<|im_end|>"]),
    ({"id": "cut-thinking", "messages": [{"role": "user", "content": "Think long."}],
      "reasoning_content": "Thinking at length", "content": "", "finish_reason": "length"},
     ["Thinking at length"]),
]


def test_a_snakemake_run_on_a_kimi_style_target(kimi, kimi_tokenizer_dir, tmp_path):  # noqa: F811
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r, _ in RAW))
    workdir = new_workdir(tmp_path)
    edit_config(workdir, {"target": {"demo": False, "path": str(kimi_tokenizer_dir), "trust_remote_code": True},
                          "data": {"raw_responses": str(raw)}})
    snakemake(workdir, "results/data/tokenized_data.jsonl")
    samples = {s["id"]: s for s in map(json.loads, (workdir / "results/data/tokenized_data.jsonl").open())}
    assert list(samples) == [r["id"] for r, _ in RAW]
    for record, emitted in RAW:
        sample = samples[record["id"]]
        start = sample["loss_mask"].index(1)
        prompt, generated = sample["input_ids"][:start], sample["input_ids"][start:]
        assert spans(kimi, generated) == emitted
        rendered = kimi.hf.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True,
                                               thinking=True)
        if record["id"] != "typed-user":
            assert prompt == kimi.hf.encode(rendered)  # the template's rendering, special tokens parsed
        else:
            assert prompt.count(kimi.think_start) == 1 and prompt.count(kimi.end_of_turn) == 1
            assert kimi.hf.decode(prompt) == rendered


def test_a_tokenizer_without_a_plain_text_route_is_refused(tmp_path):
    sealed = build_kimi_tokenizer(tmp_path / "sealed", tokenizer_class="SealedTikTokenTokenizer")
    refusal = r"tokenizer SealedTikTokenTokenizer: .* offers no way to encode plain text"
    raw, prompts = tmp_path / "raw.jsonl", tmp_path / "prompts.jsonl"
    raw.write_text(json.dumps(RAW[0][0]) + "\n")
    prompts.write_text(json.dumps({"id": "p", "messages": RAW[0][0]["messages"]}) + "\n")
    settings = dict(trust_remote_code=True, chat_template_kwargs={"thinking": True}, **TOKENS)
    with pytest.raises(InputError, match=refusal):
        tokenize_file(raw, sealed, tmp_path / "tok.jsonl", tmp_path / "report.json", max_seq_len=512,
                      overlong="error", **settings)
    with pytest.raises(InputError, match=refusal):  # by the generate service, before vLLM starts
        generate_part(prompts, sealed, tmp_path / "responses.jsonl", max_tokens=8, temperatures=[0.0],
                      samples_per_prompt=1, seed=0, vllm={"max_model_len": 512}, engine_log=tmp_path / "engine.log",
                      **settings)
    assert "vLLM" not in (tmp_path / "engine.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.log", "prompts.jsonl", "raw.jsonl", "sealed"]
