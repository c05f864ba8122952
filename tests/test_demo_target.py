"""The demo target: Kimi-style tokenizer and chat template, a model that learned, atomic and reproducible builds."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglenest.demo.data import generate_records, write_jsonl
from eaglenest.demo.target import SPECIAL_TOKENS, build_demo_target

# Fast settings: the default geometry (the one vLLM runs), fewer and shorter steps.
FAST = dict(seed=0, seq_len=128, batch_size=8, steps=40, lr=3e-3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    write_jsonl(path, generate_records(seed=0, n=800, edge_cases=False))
    return path


@pytest.fixture(scope="module")
def target(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "target"
    build_demo_target(corpus, out, **FAST)
    return out


@pytest.fixture(scope="module")
def tokenizer(target):
    return AutoTokenizer.from_pretrained(target)


def render(tokenizer, record):
    """A finished chat as the model generated it in thinking mode."""
    prompt = tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
    return prompt + record["reasoning_content"] + "</think>" + record["content"] + "<|im_end|>"


def test_special_tokens_are_single_ids(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    for token, i in zip(SPECIAL_TOKENS, ids):
        assert tokenizer.encode(token, add_special_tokens=False) == [i]
        assert tokenizer.added_tokens_decoder[i].special
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None


def test_generation_prompts(tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    thinking = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert thinking == "<|im_user|>user<|im_middle|>What is 2 + 3?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=False)
    assert plain == thinking + "</think>"
    ids = tokenizer.encode(thinking, add_special_tokens=False)
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<think>")


def test_earlier_assistant_turn_loses_its_reasoning(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "And 2 + 2?"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>1 + 1?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>2<|im_end|>"
        "<|im_user|>user<|im_middle|>And 2 + 2?<|im_end|>")


def test_unicode_round_trips(tokenizer):
    text = "Combien font 7 × 8 ÷ 2 − 1 ? Réponds, s'il te plaît 🙂\n  naïve 中文"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_model_learned(target, tokenizer):
    meta = json.loads((target / "demo_target.json").read_text())
    assert meta["heldout_loss_init"] > math.log(meta["vocab_size"]) - 0.5
    assert meta["heldout_loss"] < meta["heldout_loss_init"] - 1.5

    # Chats it has never seen, scored by the saved model as any later stage loads it.
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    assert model.config.vocab_size == len(tokenizer)
    texts = [render(tokenizer, r) for r in generate_records(seed=123, n=20, edge_cases=False)]
    ids = torch.tensor([tokenizer.encode("".join(texts), add_special_tokens=False)[:512]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < meta["heldout_loss_init"] - 1.5


def test_same_seed_same_weights(corpus, tmp_path):
    tiny = dict(FAST, steps=3)
    build_demo_target(corpus, tmp_path / "a", **tiny)
    build_demo_target(corpus, tmp_path / "b", **tiny)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_failed_build_leaves_nothing(corpus, tmp_path):
    with pytest.raises(FileNotFoundError):
        build_demo_target(tmp_path / "missing.jsonl", tmp_path / "out", **FAST)
    assert list(tmp_path.iterdir()) == []

    # Fails after the tokenizer was already written into the temporary directory.
    with pytest.raises(ValueError, match="learning rate"):
        build_demo_target(corpus, tmp_path / "out", **dict(FAST, lr=-1.0))
    assert list(tmp_path.iterdir()) == []
