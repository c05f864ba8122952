"""The demo target: Kimi-style tokenizer and chat template, a model that learned, atomic and reproducible builds;
and the Kimi-shaped one (demo_target.architecture kimi_k25), packaged as Kimi-K2.5 ships."""

import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglenest.demo.data import generate_records, write_jsonl
from eaglenest.demo.kimi import build_demo_kimi_target, vision_shapes
from eaglenest.demo.kimi_tokenizer import IM_TOKENS, NAMED, RESERVED
from eaglenest.demo.target import SPECIAL_TOKENS, build_demo_target, tool_call_text
from eaglenest.data.target import read_target_tensors, target_weight_prefix
from eaglenest.states.hf import load_target
from eaglenest.workflow.config import validate_config

from conftest import REPO, merge

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
    """A finished chat as the model generated it in thinking mode (a tool call: its section last)."""
    prompt = tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=False,
                                           add_generation_prompt=True)
    calls = tool_call_text(record["tool_calls"]) if record.get("tool_calls") else ""
    return prompt + record["reasoning_content"] + "</think>" + record["content"] + calls + "<|im_end|>"


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


@pytest.fixture(scope="module")
def kimi_target(corpus, tmp_path_factory):
    """The Kimi-shaped demo target at CI size: a few steps on short rows."""
    out = tmp_path_factory.mktemp("kimi_build") / "target"
    build_demo_kimi_target(corpus, out, **dict(FAST, steps=10, lr=5e-3))
    return out


def test_the_kimi_shaped_target_is_packaged_as_kimi_ships(kimi_target):
    config = json.loads((kimi_target / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    assert config["auto_map"] and config["torch_dtype"] == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(kimi_target, trust_remote_code=True)  # vLLM's EAGLE proposer reads it
    assert tokenizer.convert_ids_to_tokens(config["media_placeholder_token_id"]) == "<|media_pad|>"
    text = config["text_config"]
    assert text["model_type"] == "kimi_k2" and text["rope_scaling"]["type"] == "yarn" and "head_dim" not in text
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["num_hidden_layers"]) == (512, 64, 8)
    assert (text["topk_method"], text["scoring_func"], text["n_shared_experts"]) == ("noaux_tc", "sigmoid", 1)
    vision = config["vision_config"]  # Kimi's vt_ names, and the ones vLLM reads, alike
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        assert vision[key] == vision[f"vt_{key}"]
    weight_map = json.loads((kimi_target / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 2 and target_weight_prefix(kimi_target) == "language_model."
    shapes = vision_shapes(text["hidden_size"])
    tensors = read_target_tensors(kimi_target, list(shapes))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == shapes  # the tower vLLM builds, complete
    assert set(weight_map) - set(shapes) == {key for key in weight_map if key.startswith("language_model.")}


def test_the_kimi_shaped_target_has_kimis_tokenizer_and_learned(kimi_target):
    tokenizer = AutoTokenizer.from_pretrained(kimi_target, trust_remote_code=True)
    assert type(tokenizer).__name__ == "TikTokenTokenizer"
    base = tokenizer.model.n_vocab - RESERVED
    offsets = {name: offset for offset, name in NAMED.items()}
    assert [tokenizer.convert_tokens_to_ids(t) for t in IM_TOKENS] == [base + offsets[t] for t in IM_TOKENS]
    assert tokenizer.encode("<think>x</think>") == [base + 22, *tokenizer.encode("x"), base + 23]
    meta = json.loads((kimi_target / "demo_target.json").read_text())
    assert meta["vocab_size"] == base + RESERVED == json.loads((kimi_target / "config.json").read_text())["text_config"]["vocab_size"]
    assert meta["heldout_loss_init"] > math.log(meta["vocab_size"]) - 0.5
    assert meta["heldout_loss"] < meta["heldout_loss_init"] - 1.5
    assert abs(meta["heldout_loss_bfloat16"] - meta["heldout_loss"]) < 0.05  # the weights as shipped
    model = load_target(kimi_target, "float32", "cpu", trust_remote_code=True)  # the HF backend reads the wrapper
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and model.config.vocab_size == meta["vocab_size"]


def test_configs_kimi_selects_the_kimi_shaped_target_served_as_kimi():
    example = yaml.safe_load((REPO / "configs/kimi.yaml").read_text())
    config = merge(yaml.safe_load((REPO / "config.yaml").read_text()), example)  # as --configfile does
    validate_config(config, REPO / "schemas/config.schema.yaml")
    assert config["target"]["demo"] and config["target"]["trust_remote_code"]
    assert config["demo_target"]["architecture"] == "kimi_k25" and config["results"] == "results/kimi"
    assert config["vllm"]["dtype"] == "bfloat16" and config["hidden_states"]["backend"] == "vllm"
    assert yaml.safe_load((REPO / "config.yaml").read_text())["demo_target"]["architecture"] == "llama"
