"""Hidden-state extraction: the layer convention, the final state, and stable shard assignment."""

import pytest
import torch
from safetensors import safe_open

from eaglenest.states.convention import default_aux_layer_ids, resolve_aux_layer_ids
from eaglenest.states.hf import extract_shard, extract_with, load_target
from eaglenest.states.manifest import write_manifest
from eaglenest.states.parts import shard_of
from eaglenest.states.shards import length_batches, read_shard
from eaglenest.workflow.errors import InputError

SAMPLES = [
    {"id": "s1", "input_ids": [5, 17, 30, 41, 7, 99, 3], "loss_mask": [0, 0, 0, 1, 1, 1, 1]},
    {"id": "s2", "input_ids": [11, 12, 13], "loss_mask": [0, 1, 1]},
]


@pytest.fixture(scope="module")
def extracted(demo_target, tmp_path_factory):
    path = tmp_path_factory.mktemp("shards") / "shard_00000.safetensors"
    extract_shard(demo_target, SAMPLES, path, aux_layer_ids=None, dtype="float32", device="cpu",
                  trust_remote_code=False)
    return path


def test_aux_states_are_layer_inputs_in_vllm_convention(demo_target, extracted):
    model = load_target(demo_target, "float32", "cpu", trust_remote_code=False)
    ids = torch.tensor([SAMPLES[0]["input_ids"]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    aux = read_shard(extracted)[0]["aux_hidden_states"]
    H = model.config.hidden_size
    for j, k in enumerate(default_aux_layer_ids(model.config.num_hidden_layers)):
        # hidden_states[k] = input of layer k (hidden_states[0] is the embedding output)
        torch.testing.assert_close(aux[:, j * H : (j + 1) * H], out.hidden_states[k][0])


def test_stored_final_state_reproduces_the_target_logits(demo_target, extracted):
    model = load_target(demo_target, "float32", "cpu", trust_remote_code=False)
    for sample in read_shard(extracted):
        with torch.no_grad():
            logits = model(input_ids=sample["input_ids"][None]).logits[0]
            rebuilt = model.lm_head(model.model.norm(sample["final_hidden_states"]))
        torch.testing.assert_close(rebuilt, logits)
        assert sample["input_ids"].dtype == torch.int64 and sample["loss_mask"].dtype == torch.bool


def test_shard_contents_and_manifest(demo_target, extracted):
    samples = read_shard(extracted)
    assert [s["id"] for s in samples] == ["s1", "s2"]
    assert samples[1]["input_ids"].tolist() == SAMPLES[1]["input_ids"]
    assert samples[1]["loss_mask"].tolist() == [False, True, True]
    manifest = write_manifest([extracted], demo_target, extracted.parent / "manifest.json", aux_layer_ids=None, dtype="float32")
    assert manifest["aux_layer_ids"] == [2, 4, 5] and manifest["final_state"] == "pre_norm"
    with safe_open(str(extracted), framework="pt") as f:
        written = bytes(f.get_tensor("content_sha256").numpy()).hex()
    assert manifest["shards"] == [
        {"file": extracted.name, "sample_ids": ["s1", "s2"], "num_tokens": 10, "content_sha256": written}
    ]


def test_empty_shard_is_valid(demo_target, tmp_path):
    path = tmp_path / "empty.safetensors"
    extract_shard(demo_target, [], path, aux_layer_ids=None, dtype="bfloat16", device="cpu", trust_remote_code=False)
    assert read_shard(path) == []


def test_aux_layer_ids_are_checked():
    assert resolve_aux_layer_ids(None, 61) == [2, 30, 58]  # Kimi-K2.5, vLLM's default
    for bad in ([1, 2], [2, 2, 3], [2, 4, 8]):
        with pytest.raises(InputError, match="aux_layer_ids"):
            resolve_aux_layer_ids(bad, 8)


def test_shard_assignment_is_stable_when_samples_are_appended():
    ids = [f"sample-{i}" for i in range(200)]
    before = {i: shard_of(i, 7) for i in ids}
    after = {i: shard_of(i, 7) for i in ids + [f"new-{i}" for i in range(50)]}
    assert all(after[i] == before[i] for i in ids)
    assert len(set(before.values())) == 7  # every shard gets samples


def mixed_samples(vocab_size, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"id": f"m{i}", "input_ids": torch.randint(0, vocab_size, (n,), generator=generator).tolist(),
             "loss_mask": [0] + [1] * (n - 1)} for i, n in enumerate(lengths)]


@pytest.mark.parametrize("target", ["demo", "deepseek"])
def test_batched_extraction_equals_one_at_a_time(target, demo_target, tmp_path):
    """Padded batches of mixed lengths (several sequences per forward) give the states of one
    sequence per forward, within float rounding: wrong states at batch > 1 are a known failure of
    other extractors. On the demo Llama and on a DeepSeek-V3 (MLA + MoE, Kimi's text model)."""
    from tiny_deepseek import build_tiny_deepseek

    if target == "deepseek":
        build_tiny_deepseek(tmp_path / "deepseek")
    target_dir = demo_target if target == "demo" else tmp_path / "deepseek"
    model = load_target(target_dir, "float32", "cpu", trust_remote_code=False)
    samples = mixed_samples(model.config.vocab_size, [37, 5, 120, 64, 1, 90, 33, 7])
    lengths = [len(sample["input_ids"]) for sample in samples]
    assert [len(batch) for batch in length_batches(range(len(samples)), lengths, 6 * 120)] == [7, 1]  # 4 or more a forward
    one, batched = tmp_path / "one.safetensors", tmp_path / "batched.safetensors"
    extract_with(model, samples, one, aux_layer_ids=None, dtype="float32", batch_tokens=1)
    extract_with(model, samples, batched, aux_layer_ids=None, dtype="float32", batch_tokens=6 * 120)
    assert [s["id"] for s in read_shard(batched)] == [s["id"] for s in samples]  # batched by length, written in order
    for a, b in zip(read_shard(one), read_shard(batched), strict=True):
        assert a["id"] == b["id"] and torch.equal(a["input_ids"], b["input_ids"])
        for key in ("aux_hidden_states", "final_hidden_states"):
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4)
