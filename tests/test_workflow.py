"""The user stories, on real Snakemake runs of a copy of this workflow in a temporary folder."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import (FAST_PROMPTS, REPO, assert_tracked_as_logged, edit_config, mtimes, new_workdir, planned, snakemake,
                      tensorboard_scalars)
from eaglenest.data.generate import answers
from eaglenest.workflow.config import generation_temperatures, validate_config
from eaglenest.workflow.serving import draft_sample_methods, drafter_engines, fitted_temperature, method_temperatures

ALL_RULES = {  # tokenize and everything downstream of it
    "tokenize", "token_freq", "vocab_map", "shard_samples", "hidden_states", "hidden_states_manifest",
    "train_drafter", "export_eagle", "check_drafter", "evaluate_offline", "eval_prompts", "vllm_baseline",
    "vllm_speculative", "agreement_states", "evaluate_vllm", "summary", "plan", "report_figures", "all",
}
UPSTREAM = {"build_demo_target", "engine_start_check", "split_prompts", "generate_part", "generate_responses"}


def test_story1_one_run_builds_every_artifact_then_nothing_is_stale(built, tmp_path):
    assert planned(new_workdir(tmp_path)).keys() == ALL_RULES | UPSTREAM
    results = built / "results"
    for path in [
        "target/config.json", "responses/raw_responses.jsonl", "data/tokenized_data.jsonl", "data/tokenize_report.json", "data/token_freq.pt",
        "vocab/d2t.pt", "vocab/t2d.pt", "vocab/coverage.json", "hidden_states/manifest.json",
        "hidden_states/shard_00000.safetensors", "hidden_states/shard_00002.safetensors",
        "drafter/config.json", "drafter/model.safetensors", "train/train_log.tsv", "train/drafter_config.json",
        "eval/offline_metrics.json", "eval/drafter_check.json", "eval/vllm_metrics.json",
        "eval/prompts/heldout.jsonl", "eval/prompts/tools.jsonl", "eval/vllm_baseline.json",
        "eval/vllm_baseline_outputs.jsonl", "eval/vllm_speculative/greedy/K3.json",
        "eval/vllm_speculative/probabilistic/K3.json",
        "eval/agreement_states/layers.json",
        "eval/agreement_states/states_00000.safetensors", "drafter_eagle/config.json", "drafter_eagle/model.safetensors",
        "summary.md",
    ]:
        assert (results / path).is_file(), path
    manifest = json.loads((results / "hidden_states/manifest.json").read_text())
    report = json.loads((results / "data/tokenize_report.json").read_text())
    config = yaml.safe_load((built / "config.yaml").read_text())
    per_prompt = len(answers("p", generation_temperatures(config), config["generate"]["samples_per_prompt"]))
    assert per_prompt == 2  # generate.temperatures null: eval.temperatures' greedy answer and a sampled one
    assert sum(len(s["sample_ids"]) for s in manifest["shards"]) == report["samples_out"] == FAST_PROMPTS * per_prompt
    coverage = json.loads((results / "vocab/coverage.json").read_text())
    assert coverage["coverage"] == coverage["covered_tokens"] / coverage["generated_tokens"] > 0
    for rule in ALL_RULES | UPSTREAM:
        if rule not in ("all", "hidden_states", "generate_part", "eval_prompts", "vllm_speculative"):
            assert (results / "logs" / f"{rule}.log").is_file(), rule  # the others: a log per shard, part, suite or K
    assert {p.name for p in (results / "logs/eval_prompts").iterdir()} == {"heldout.log", "tools.log"}
    assert {str(p.relative_to(results / "logs/vllm_speculative")) for p in (results / "logs/vllm_speculative").glob("*/*")} \
        == {f"{method}/K{k}.log" for method in ("greedy", "probabilistic") for k in (3,)}
    shutil.copytree(built, tmp_path / "built", symlinks=True)  # a copy: nothing runs Snakemake in `built` (conftest)
    assert planned(tmp_path / "built") == {}


def test_the_demo_leaves_tensorboard_runs_of_its_training_and_evaluations(built):
    """What `tensorboard --logdir results/` shows (README): training's run, one point per optimizer
    step of each figure of train_log.tsv (whose rows are their means), lr and tokens/s; the
    evaluations' runs, the acceptance at each position k (as step k) and the mean acceptance
    length (step 0) of every run in offline_metrics.json and vllm_metrics.json."""
    results = built / "results"
    assert_tracked_as_logged(tensorboard_scalars(results / "train/tensorboard/train_drafter"),
                             results / "train/train_log.tsv")

    def expected(prefix, fields):
        rates = fields["acceptance_rate_per_position"]
        return {f"{prefix}/acceptance": [(k, pytest.approx(rate)) for k, rate in enumerate(rates, 1)],
                f"{prefix}/mean_acceptance_length": [(0, pytest.approx(fields["mean_acceptance_length"]))]}

    offline = json.loads((results / "eval/offline_metrics.json").read_text())
    prefix = f"offline/heldout/K{offline['num_speculative_tokens']}"
    assert tensorboard_scalars(results / "eval/tensorboard/evaluate_offline") == \
        expected(f"{prefix}/every_anchor", offline) | expected(f"{prefix}/served", offline["served"])
    runs = json.loads((results / "eval/vllm_metrics.json").read_text())["runs"]
    tags = {}
    for run in runs:
        tags |= expected(f"vllm/{run['suite']}/T{run['temperature']:g}/{run['draft_sample_method']}"
                         f"/K{run['num_speculative_tokens']}/c{run['concurrency']}", run)
    assert len(tags) == 2 * len(runs) and tensorboard_scalars(results / "eval/tensorboard/evaluate_vllm") == tags


PROGRESS = re.compile(r"INFO [\w.]+: (?P<label>[^:]+): (?P<done>\d+)/(?P<total>\d+) (?P<unit>\w+), (?P<rate>[\d.]+) "
                      r"(?P=unit)/s(?:, (?P<work_rate>[\d,]+) (?P<work>[\w ]+)/s)?, elapsed (?P<elapsed>[\d:.]+(?: s)?), "
                      r"ETA (?P<eta>.+)$", re.M)


def progress_runs(log):
    """The progress lines (eaglenest/workflow/progress.py) of a rule's log, one list per loop: a
    loop's first line is at 0 done."""
    runs = []
    for line in PROGRESS.finditer(log.read_text()):
        if int(line["done"]) == 0:
            runs.append([])
        runs[-1].append(line)
    return runs


def test_the_long_stages_log_done_total_rate_and_eta_from_start_to_end(built):
    """README: every long stage logs done/total, its rate and an ETA. Each loop of training, the
    offline evaluation and evaluate_vllm's agreement check logs a line at the start (nothing done,
    ETA unknown) and one at the end (all done, its rate, ETA 0), with as many done as there was
    work; the interval between lines is test_progress's."""
    results = built / "results"
    steps = int((results / "train/train_log.tsv").read_text().splitlines()[-1].split("\t")[0])
    heldout = json.loads((results / "eval/offline_metrics.json").read_text())["heldout_samples"]
    runs = json.loads((results / "eval/vllm_metrics.json").read_text())["runs"]
    checks = {(r["suite"], r["temperature"], r["draft_sample_method"], r["prompts"]) for r in runs}  # one per text and size
    expected = {
        "train_drafter": [("training", steps, "steps", "supervised tokens")],
        "evaluate_offline": [("offline evaluation", heldout, "samples", "tokens")],
        "evaluate_vllm": sorted((f"agreement check, T={t:g}, {method}", prompts, "samples", None)
                                for _, t, method, prompts in checks),
    }
    for rule, loops in expected.items():
        logged = progress_runs(results / "logs" / f"{rule}.log")
        assert sorted((run[0]["label"], int(run[0]["total"]), run[0]["unit"], run[0]["work"]) for run in logged) == loops, rule
        for run in logged:
            first, last = run[0], run[-1]
            assert (first["rate"], first["elapsed"], first["eta"]) == ("0.00", "0.0 s", "?"), first[0]
            assert last["done"] == last["total"] and float(last["rate"]) > 0 and last["eta"] == "0.0 s", last[0]
            assert [int(line["done"]) for line in run] == sorted(int(line["done"]) for line in run), rule


def test_story2_a_fix_in_tokenization_code_rebuilds_tokenize_and_keeps_unchanged_shards(workdir):
    module = workdir / "eaglenest" / "data" / "records.py"  # imported by the tokenize stage only
    module.write_text(module.read_text().replace('FINISH_REASONS = ("stop", "length")', 'FINISH_REASONS = ("stop", "length", "abort")'))
    plan = planned(workdir)  # before the split has run, every shard is a candidate
    assert set(plan) - {"all"} == ALL_RULES - {"all"} and plan["hidden_states"] == 3
    assert "reason: Params have changed since last execution" in snakemake(workdir, "-n", "tokenize").stdout  # the code fingerprint
    before = mtimes(workdir)
    snakemake(workdir, "results/hidden_states/manifest.json")  # where shard staleness is decided
    after = mtimes(workdir)
    changed = {path for path in before if after[path] != before[path]}
    assert "results/data/tokenized_data.jsonl" in changed
    # the fix changes no token: the split finds every shard's samples unchanged, nothing is re-extracted
    # (the manifest reruns: Snakemake re-decides only the checkpoint's direct dependents)
    assert not any(path.startswith(("results/target/", "results/responses/", "results/hidden_states/shard_")) for path in changed)
    # tokenize wrote the same bytes, so nothing downstream of it is stale either: no training, no vLLM run
    assert planned(workdir) == {}


@pytest.mark.parametrize("module", ["data/tokenize.py", "states/hf.py", "states/shards.py"])
def test_comment_and_whitespace_edits_rebuild_nothing(workdir, module):
    path = workdir / "eaglenest" / module
    source = path.read_text()
    edited = re.sub(r"^(import \w+)$", r"\1  # a comment\n", source, count=1, flags=re.M).replace("\n\n\ndef ", "\n\n\n# note\n\n\ndef ")
    assert edited.count("# a comment") == 1 and "# note" in edited
    path.write_text(edited)
    assert planned(workdir) == {}


def test_story3_draft_vocab_size_reruns_vocab_training_and_evaluation_only(workdir):
    edit_config(workdir, {"vocab": {"draft_vocab_size": 96}})
    assert set(planned(workdir)) == {"vocab_map", "plan", "train_drafter", "export_eagle", "check_drafter",
                                     "evaluate_offline", "vllm_speculative", "evaluate_vllm", "summary",
                                     "report_figures", "all"}
    snakemake(workdir, "results/eval/offline_metrics.json")  # vocab, training, offline evaluation (vLLM: test_vllm)
    coverage = json.loads((workdir / "results/vocab/coverage.json").read_text())
    assert coverage["draft_vocab_size"] == 96
    offline = json.loads((workdir / "results/eval/offline_metrics.json").read_text())
    assert offline["served"]["num_drafts"] > 0
    # the oracle drafting the target's argmax (from the shards' final states): half of the held-out
    # text was sampled at temperature 1, where the text is not always the argmax
    served = offline["served"]
    assert 0 < served["ceiling_per_position"][0] < 1 and all(c <= 1 for c in served["ceiling_per_position"])
    assert served["share_of_ceiling_per_position"] == pytest.approx(
        [a / c for a, c in zip(served["acceptance_rate_per_position"], served["ceiling_per_position"])])
    assert set(planned(workdir)) == {"plan", "export_eagle", "check_drafter", "vllm_speculative", "evaluate_vllm",
                                     "summary", "report_figures", "all"}  # what is left


def test_story4_force_one_rule_or_regenerate_one_artifact(workdir):
    assert set(planned(workdir, "-R", "tokenize")) == ALL_RULES
    d2t = workdir / "results/vocab/d2t.pt"
    d2t.unlink()
    assert planned(workdir, "results/vocab/d2t.pt") == {"vocab_map": 1}
    snakemake(workdir, "results/vocab/d2t.pt")
    assert d2t.is_file()
    assert planned(workdir, "-f", "results/vocab/d2t.pt") == {"vocab_map": 1}


def test_bad_input_fails_with_file_line_field_and_leaves_nothing(workdir):
    edit_config(workdir, {"data": {"raw_responses": "resources/demo/raw_responses.jsonl"}})  # responses made elsewhere
    raw = workdir / "resources/demo/raw_responses.jsonl"
    lines = raw.read_text().splitlines()
    lines[4] = json.dumps(json.loads(lines[4]) | {"finish_reason": 3})
    raw.write_text("\n".join(lines) + "\n")
    result = snakemake(workdir, check=False)
    assert result.returncode != 0
    assert re.search(r"raw_responses\.jsonl:5: field 'finish_reason': expected str, got int", result.stderr)
    log = (workdir / "results/logs/tokenize.log").read_text()  # where Snakemake points the user
    assert re.search(r"raw_responses\.jsonl:5: field 'finish_reason': expected str, got int", log)
    assert not (workdir / "results/data/tokenized_data.jsonl").exists()
    assert not list((workdir / "results/data").glob(".*tmp"))


def test_a_bad_suite_file_fails_its_prompts_with_file_line_field(workdir):
    """An evaluation suite is read as data.prompts is: the error names the file, line and field in
    the rule's log, and no prompts file is left; the held-out suite is untouched."""
    suite = workdir / "resources/my_suite.jsonl"
    lines = (REPO / "resources/demo/eval_chat.jsonl").read_text().splitlines()[:3]
    lines[1] = json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "?"}]})
    suite.write_text("\n".join(lines) + "\n")
    edit_config(workdir, {"eval": {"suites": [{"name": "mine", "prompts": "resources/my_suite.jsonl"}]}})
    result = snakemake(workdir, "results/eval/prompts/mine.jsonl", check=False)
    message = (r"my_suite\.jsonl:2: field 'messages\[1\]\.role': 'robot' is no role the chat template takes "
               r"\(system, user, assistant, tool\)")
    assert result.returncode != 0 and re.search(message, (workdir / "results/logs/eval_prompts/mine.log").read_text())
    assert not (workdir / "results/eval/prompts/mine.jsonl").exists()
    edit_config(workdir, {"eval": {"suites": [{"name": "heldout", "prompts": "resources/my_suite.jsonl"}]}})
    result = snakemake(workdir, "-n", check=False)
    assert result.returncode != 0 and "config: eval.suites: 'heldout' is the training data's held-out split" in (
        result.stdout + result.stderr)


@pytest.mark.parametrize(
    "update, message",
    [
        ({"vocab": {"draft_vocab_sise": 3}}, r"config: vocab: Additional properties are not allowed \('draft_vocab_sise' was unexpected\)"),
        ({"tokenize": {"max_seq_len": "long"}}, r"config: tokenize\.max_seq_len: 'long' is not of type 'integer'"),
        ({"tokenize": {"think_end": None}}, r"config: tokenize\.think_start/think_end: both set \(a reasoning target\) "
                                            r"or both null \(a target without a reasoning block\), got '<think>' and None"),
        ({"generate": {"temperature": 1.0}}, r"config: generate\.temperature: replaced by generate\.temperatures \(a list; "
                                             r"null: eval\.temperatures\)"),
        ({"generate": {"temperatures": [1.0, 1.0]}}, r"config: generate\.temperatures: \[1\.0, 1\.0\] has non-unique elements"),
        ({"eval": {"draft_sample_methods": ["greedy", "typical"]}},
         r"config: eval\.draft_sample_methods\.1: 'typical' is not one of \['greedy', 'probabilistic'\]"),
        ({"eval": {"draft_sample_methods": ["probabilistic"], "temperatures": [0.0]}},
         r"config: eval\.draft_sample_methods: probabilistic drafts only above temperature 0 \(at 0 vLLM drafts the "
         r"argmax\), and eval\.temperatures \[0\.0\] has none above 0"),
        ({"eval": {"draft_sample_methods": ["probabilistic"]}},
         r"config: eval\.draft_sample_methods: temperature 0 \(in eval\.temperatures\) is drafted greedily by every "
         r"method: include greedy"),
        ({"tracking": {"wandb": {"mode": "cloud"}}}, r"config: tracking\.wandb\.mode: 'cloud' is not one of \['online', 'offline'\]"),
    ],
)
def test_config_errors_name_the_key(tmp_path, update, message):
    workdir = new_workdir(tmp_path)
    edit_config(workdir, update)
    result = snakemake(workdir, "-n", check=False)
    assert result.returncode != 0 and re.search(message, result.stdout + result.stderr)


def test_generation_follows_the_served_temperatures_unless_it_lists_its_own():
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    validate_config(config, REPO / "schemas/config.schema.yaml")
    assert config["generate"]["temperatures"] is None  # the default: what eval.temperatures serves
    assert generation_temperatures(config) == config["eval"]["temperatures"] == [0.0, 1.0]
    config["generate"]["temperatures"] = [0.7]
    assert generation_temperatures(config) == [0.7]
    config["generate"] = {key: value for key, value in config["generate"].items() if key != "temperatures"}
    config["generate"]["temperature"] = 0.0  # a config from before temperatures were a list
    with pytest.raises(ValueError, match=r"^config: generate\.temperature: replaced by generate\.temperatures"):
        validate_config(config, REPO / "schemas/config.schema.yaml")


def test_the_draft_methods_default_to_both_where_a_temperature_is_above_0():
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    assert config["eval"]["draft_sample_methods"] is None
    assert draft_sample_methods(config) == ["greedy", "probabilistic"]
    assert drafter_engines(config) == [("greedy", 1), ("greedy", 3), ("probabilistic", 1), ("probabilistic", 3)]
    config["eval"]["temperatures"] = [0.0]
    assert draft_sample_methods(config) == ["greedy"]  # at 0 vLLM drafts the argmax with either
    config["eval"] |= {"temperatures": [1.0], "draft_sample_methods": ["probabilistic"]}
    assert draft_sample_methods(config) == ["probabilistic"]
    assert method_temperatures("probabilistic", [0.0, 0.6, 1.0]) == [0.6, 1.0]
    assert method_temperatures("greedy", [0.0, 0.6, 1.0]) == [0.0, 0.6, 1.0]


def test_training_fits_the_largest_served_temperature_above_0_unless_it_names_its_own():
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    validate_config(config, REPO / "schemas/config.schema.yaml")
    assert config["train"]["temperature"] is None  # the default: what eval.temperatures serves
    for served, fitted in (([0.0, 1.0], 1.0), ([0.0, 0.6], 0.6), ([0.0], 1.0), ([0.3, 0.8, 0.0], 0.8)):
        config["eval"]["temperatures"] = served
        assert fitted_temperature(config) == fitted
    config["train"]["temperature"] = 0.7
    assert fitted_temperature(config) == 0.7
    for key, value, message in (("temperature", 0, r"0 is less than or equal to the minimum of 0"),
                                ("tv_weight", -0.5, r"-0\.5 is less than the minimum of 0")):
        config["train"][key] = value
        with pytest.raises(ValueError, match=rf"^config: train\.{key}: {message}"):
            validate_config(config, REPO / "schemas/config.schema.yaml")
        config["train"][key] = 0.5


def test_lint_is_clean():
    result = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0 and "Congratulations" in result.stdout + result.stderr
