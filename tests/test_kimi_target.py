"""A target packaged as Kimi-K2.5 ships (tests/kimi_target.py) reads, loads, extracts and heads
exactly as the same text model as a plain checkpoint, with a tied head and an untied one."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config

from eaglenest.data.target import (
    read_target_embedding,
    read_target_tensors,
    target_config,
    target_dtype,
    target_is_wrapped,
    target_ties_embeddings,
    target_weight_prefix,
)
from eaglenest.states.hf import extract_shard, load_target, text_model_config
from eaglenest.states.manifest import write_manifest
from eaglenest.states.shards import read_shard
from eaglenest.drafter.target_head import TargetHead
from eaglenest.workflow.errors import InputError
from kimi_target import build_kimi_target, build_plain_twin

SAMPLES = [
    {"id": "a", "input_ids": [5, 17, 30, 41, 7, 99, 3, 250, 411], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1, 1]},
    {"id": "b", "input_ids": [11, 12, 13, 500], "loss_mask": [0, 1, 1, 1]},
]
HEAD = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def targets(request, tmp_path_factory):
    """(plain twin, Kimi-packaged target, tied) built from the same weights."""
    root = tmp_path_factory.mktemp("kimi")
    build_plain_twin(root / "plain", tied=request.param)
    build_kimi_target(root / "kimi", tied=request.param)
    return root / "plain", root / "kimi", request.param


def write_config(directory, config):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))


def test_the_package_is_kimis(targets):
    _, kimi, tied = targets
    config = json.loads((kimi / "config.json").read_text())
    assert config["model_type"] == "kimi_k25" and "vision_config" in config and "auto_map" in config
    assert "head_dim" not in config["text_config"] and config["text_config"]["rope_scaling"]["type"] == "yarn"
    weight_map = json.loads((kimi / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 2
    assert all(key.startswith(("language_model.", "vision_tower.", "mm_projector.")) for key in weight_map)
    assert any(key.startswith("vision_tower.") for key in weight_map)
    assert ("language_model.lm_head.weight" not in weight_map) == tied


def test_config_and_tensors_read_through_the_wrapper(targets):
    plain, kimi, tied = targets
    text, twin = target_config(kimi), target_config(plain)
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "kv_lora_rank", "rms_norm_eps"):
        assert text[key] == twin[key]
    assert target_is_wrapped(kimi) and not target_is_wrapped(plain)
    assert target_dtype(kimi) == target_dtype(plain) == "float32"
    assert target_ties_embeddings(kimi) == target_ties_embeddings(plain) == tied
    assert target_weight_prefix(kimi) == "language_model." and target_weight_prefix(plain) == ""
    names = HEAD + ["model.layers.3.mlp.experts.5.down_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"]
    read, expected = read_target_tensors(kimi, names), read_target_tensors(plain, names)
    assert read.keys() == expected.keys() and ("lm_head.weight" in read) == (not tied)
    for name in read:
        assert torch.equal(read[name], expected[name]), name
    assert torch.equal(read_target_embedding(kimi), read_target_embedding(plain))


def test_settings_are_read_from_text_config_or_else_the_wrapper(tmp_path):
    write_config(tmp_path, {"text_config": {}, "tie_word_embeddings": True, "torch_dtype": "bfloat16"})
    assert target_ties_embeddings(tmp_path) and target_dtype(tmp_path) == "bfloat16"
    write_config(tmp_path, {"text_config": {"tie_word_embeddings": False, "dtype": "float32"},
                            "tie_word_embeddings": True, "torch_dtype": "bfloat16"})
    assert not target_ties_embeddings(tmp_path) and target_dtype(tmp_path) == "float32"
    write_config(tmp_path, {"text_config": {"tie_word_embeddings": True}})
    assert target_ties_embeddings(tmp_path) and target_dtype(tmp_path) is None


def test_load_target_gives_the_plain_models_logits(targets):
    plain, kimi, tied = targets
    # As Kimi runs (its tokenizer needs remote code): the auto_map's files do not exist, so none is run.
    model = load_target(kimi, "float32", "cpu", trust_remote_code=True)
    twin = load_target(plain, "float32", "cpu", trust_remote_code=False)
    assert model.config.rope_parameters["rope_type"] == "yarn" and model.config.tie_word_embeddings == tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.tensor([SAMPLES[0]["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, twin(input_ids=ids).logits, rtol=0, atol=0)


def test_hf_states_and_manifest_equal_the_plain_models(targets, tmp_path):
    plain, kimi, _ = targets
    shards, manifests = [], []
    for name, target in (("kimi", kimi), ("plain", plain)):
        shard = tmp_path / name / "shard_00000.safetensors"
        shard.parent.mkdir()
        extract_shard(target, SAMPLES, shard, aux_layer_ids=None, dtype="float32", device="cpu",
                      trust_remote_code=name == "kimi")
        shards.append(read_shard(shard))
        manifests.append(write_manifest([shard], target, tmp_path / name / "manifest.json", aux_layer_ids=None,
                                        dtype="float32"))
    for got, want in zip(*shards, strict=True):
        for key in ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states"):
            assert torch.equal(got[key], want[key]), key
    assert manifests[0] == manifests[1] and manifests[0]["aux_layer_ids"] == [2, 4, 5]


def test_target_head_gives_the_plain_models_distribution(targets):
    plain, kimi, _ = targets
    final = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(0))
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[::3] = True
    probs, in_vocab = TargetHead(kimi).distribution(final, t2d)
    want_probs, want_in_vocab = TargetHead(plain).distribution(final, t2d)
    torch.testing.assert_close(probs, want_probs, rtol=0, atol=0)
    assert torch.equal(in_vocab, want_in_vocab)


def test_a_tie_stated_by_the_wrapper_alone_is_honoured(tmp_path):
    build_plain_twin(tmp_path / "plain", tied=True)
    build_kimi_target(tmp_path / "kimi", tied=True)
    config = json.loads((tmp_path / "kimi" / "config.json").read_text())
    del config["text_config"]["tie_word_embeddings"]
    write_config(tmp_path / "kimi", config)
    assert torch.equal(TargetHead(tmp_path / "kimi").lm_head, TargetHead(tmp_path / "plain").lm_head)
    model = load_target(tmp_path / "kimi", "float32", "cpu", trust_remote_code=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_text_model_types(tmp_path):
    write_config(tmp_path, {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "hidden_size": 64}})
    config = text_model_config(tmp_path)
    assert isinstance(config, DeepseekV3Config) and config.hidden_size == 64
    write_config(tmp_path, {"model_type": "kimi_k25", "text_config": {"model_type": "no_such_model"}})
    with pytest.raises(InputError, match="text_config.model_type 'no_such_model'.*set text_config.model_type"):
        load_target(tmp_path, "float32", "cpu", trust_remote_code=True)


def test_a_checkpoint_missing_weights_is_refused(tmp_path):
    build_kimi_target(tmp_path, tied=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = "language_model.model.layers.3.mlp.gate.weight"
    tensors = load_file(tmp_path / index["weight_map"][name])
    del tensors[name]
    save_file(tensors, tmp_path / index["weight_map"].pop(name), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"lacks 1 of the model's weights, e.g. \['model.layers.3.mlp.gate.weight'\]"):
        load_target(tmp_path, "float32", "cpu", trust_remote_code=False)
