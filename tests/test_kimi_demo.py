"""The Kimi-shaped demo at CI size (configs/kimi.yaml with tests/conftest.py's KIMI_CI): a target
packaged as Kimi-K2.5 ships (MLA, MoE, YaRN, the kimi_k25 wrapper, a Kimi-style tokenizer),
answering in vLLM through KimiK25ForConditionalGeneration in bfloat16, its drafter of the layer the
workflow picks for an MLA target, served in vLLM and held to the offline estimate on the same text."""

import json

from eaglenest.drafter.export import MLA_ARCHITECTURE


def test_the_kimi_shaped_run_serves_an_mla_drafter_that_vllm_drafts_as_estimated(kimi_run):
    target = json.loads((kimi_run / "target/config.json").read_text())
    assert target["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert json.loads((kimi_run / "engine_start_check.json").read_text()) == {"ok": True}
    trained = json.loads((kimi_run / "train/drafter_config.json").read_text())
    assert trained["layer"] == "mla" and not trained["norm_before_fc"]  # drafter.layer null on an MLA target
    assert {key: trained[key] for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim")} == {key: target["text_config"][key] for key in
                                                             ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                              "qk_rope_head_dim", "v_head_dim")}
    exported = json.loads((kimi_run / "drafter/config.json").read_text())
    assert exported["architectures"] == [MLA_ARCHITECTURE] and exported["model_type"] == "deepseek_v2"
    metrics = json.loads((kimi_run / "eval/vllm_metrics.json").read_text())  # written only when every run agrees
    assert metrics["engine_dtype"] == "bfloat16"
    [run] = metrics["runs"]
    assert (run["temperature"], run["draft_sample_method"], run["num_speculative_tokens"]) == (0.0, "greedy", 3)
    assert run["agrees"] and run["num_drafts"] > 0
    # bfloat16: the tolerance is the greedy one plus the share of drafts whose outcome rounding decides
    decided = run["offline"]["rounding_decided_per_position"]
    assert run["tolerance_per_position"] == [metrics["agreement"]["greedy_tolerance"] + share for share in decided]
    assert run["max_disagreement"] <= max(run["tolerance_per_position"])
    for divergence in run.get("divergences", []):  # bfloat16: speculation may change greedy text at near-ties only
        assert divergence["near_tie"]
    # compared on the drafts whose guesses all fall on vLLM's text (its split at tool-call spans counts
    # those), and made before that text left the replayed one (all of them where it never did)
    on_text = run["tool_call_spans"]["num_drafts"] + run["outside_tool_call_spans"]["num_drafts"]
    assert 0 < run["vllm_same_text"]["num_drafts"] <= on_text <= run["num_drafts"]
    if not run.get("replayed_text_differs"):
        assert run["vllm_same_text"]["num_drafts"] == on_text
