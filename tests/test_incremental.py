"""Only what is stale is rebuilt, down to single shards: real Snakemake runs on a built workflow copy.

Most runs stop at the manifest (MANIFEST target), which is where shard staleness is decided;
what follows the manifest is covered by test_workflow.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO, edit_config, planned, snakemake
from eaglenest.states.parts import shard_of
from eaglenest.train.init_drafter import NORM_DEFAULTS

MANIFEST = "results/hidden_states/manifest.json"
RAW = "results/responses/raw_responses.jsonl"
NUM_SHARDS = 3  # conftest.FAST
# a new drafter is measured again in vLLM; the runs without it (vllm_baseline) and the target's
# states of their text (agreement_states) stay
DOWNSTREAM_OF_TRAINING = {"train_drafter", "export_eagle", "check_drafter", "evaluate_offline", "vllm_speculative",
                          "evaluate_vllm", "summary", "report_figures", "all"}
NEW_STATES = {"agreement_states"}  # other aux layers or dtype: the agreement check's states too
PLAN = {"plan", "report_figures", "all"}  # the plan and the report that shows it
# the recipe settings turned from the workflow's defaults
CONFIG = yaml.safe_load((REPO / "config.yaml").read_text())
OTHER_OPTIMIZER = {"adamw": "muon", "muon": "adamw"}[CONFIG["train"]["optimizer"]]
# the norm flags the other way round from config.yaml's (null: NORM_DEFAULTS)
FLIPPED_NORMS = {flag: not (value if CONFIG["drafter"][flag] is None else CONFIG["drafter"][flag])
                 for flag, value in NORM_DEFAULTS.items()}


def shard_files(workdir):
    """{shard file: (mtime_ns, sha256)} of the hidden-state shards."""
    return {
        p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted((workdir / "results/hidden_states").glob("shard_*.safetensors"))
    }


def changed(before, after):
    return {name for name in before if after.get(name) != before[name]}


def records(workdir):
    return [json.loads(line) for line in (workdir / RAW).read_text().splitlines()]


def write_records(workdir, rows):
    (workdir / RAW).write_text("".join(json.dumps(r) + "\n" for r in rows))


def ids_in_shard(shard, count):
    ids = (f"appended-{i}" for i in range(10_000))
    return [i for i in ids if shard_of(i, NUM_SHARDS) == shard][:count]


def manifest(workdir):
    return json.loads((workdir / MANIFEST).read_text())


def test_appended_samples_reextract_only_the_shards_that_gain_them(workdir):
    rows = records(workdir)
    write_records(workdir, rows + [rows[0] | {"id": i} for i in ids_in_shard(1, 2)])
    before = shard_files(workdir)
    result = snakemake(workdir, MANIFEST)  # one plain run: the checkpoint re-decides after the split
    assert changed(before, shard_files(workdir)) == {"shard_00001.safetensors"}
    assert result.stderr.count("localrule hidden_states:") == 1
    assert "reason: Updated input files: results/data/shards/part_00001.sha256" in result.stderr
    assert set(ids_in_shard(1, 2)) <= set(manifest(workdir)["shards"][1]["sample_ids"])
    assert planned(workdir, MANIFEST) == {}


def test_editing_one_sample_reextracts_only_its_shard_and_dry_run_names_it(workdir):
    rows = records(workdir)
    edited = 5
    ids = rows[edited]["completion_token_ids"]
    j = next(j for j, token in enumerate(ids) if token < 500)  # a text token: the specials are at the end
    ids[j] = 300 if ids[j] != 300 else 301
    write_records(workdir, rows)
    shard = shard_of(rows[edited]["id"], NUM_SHARDS)
    before = shard_files(workdir)
    snakemake(workdir, "shard_samples")  # the cheap split first: then -n knows the exact shards
    dry = snakemake(workdir, "-n", MANIFEST).stdout
    assert planned(workdir, MANIFEST) == {"hidden_states": 1, "hidden_states_manifest": 1}
    assert f"reason: Updated input files: results/data/shards/part_{shard:05d}.sha256" in dry
    snakemake(workdir, MANIFEST)
    assert changed(before, shard_files(workdir)) == {f"shard_{shard:05d}.safetensors"}


@pytest.mark.parametrize(
    "update, reruns, shards",
    [
        ({"hidden_states": {"aux_layer_ids": [1, 4, 6]}},
         {"hidden_states", "hidden_states_manifest"} | PLAN | DOWNSTREAM_OF_TRAINING | NEW_STATES, 3),
        ({"hidden_states": {"dtype": "bfloat16"}},
         {"hidden_states", "hidden_states_manifest"} | PLAN | DOWNSTREAM_OF_TRAINING | NEW_STATES, 3),
        ({"hidden_states": {"dtype": "float8_e4m3fn"}},  # FP8: the same, and nothing else
         {"hidden_states", "hidden_states_manifest"} | PLAN | DOWNSTREAM_OF_TRAINING | NEW_STATES, 3),
        ({"demo_target": {"seed": 1}}, "everything", 3),
        ({"tokenize": {"max_seq_len": 100}}, {"tokenize", "token_freq", "vocab_map", "shard_samples", "hidden_states",
                                              "hidden_states_manifest", "eval_prompts", "vllm_baseline"}
         | PLAN | DOWNSTREAM_OF_TRAINING | NEW_STATES, 3),
        ({"train": {"lr": 0.002}}, DOWNSTREAM_OF_TRAINING, 0),  # the plan does not depend on it
        ({"train": {"supervise": "all", "step_weight_decay": 1.0, "schedule": "linear", "max_grad_norm": 1.0}},
         DOWNSTREAM_OF_TRAINING, 0),  # the recipe retrains, and nothing upstream
        ({"train": {"optimizer": OTHER_OPTIMIZER, "train_lm_head": False}}, PLAN | DOWNSTREAM_OF_TRAINING, 0),  # its memory
        ({"drafter": FLIPPED_NORMS}, PLAN | DOWNSTREAM_OF_TRAINING, 0),  # the norms retrain (and change its memory)
        ({"train": {"epochs": 3, "tokens_per_step": 80}}, PLAN | DOWNSTREAM_OF_TRAINING, 0),  # epochs: the plan's training time
        ({"vocab": {"draft_vocab_size": 96}}, {"vocab_map"} | PLAN | DOWNSTREAM_OF_TRAINING, 0),
        ({"eval": {"max_prompts": 40}}, {"eval_prompts", "vllm_baseline", "vllm_speculative", "agreement_states",
                                         "evaluate_vllm", "summary", "report_figures", "all"}, 0),
        ({"eval": {"temperatures": [0.0]}, "generate": {"temperatures": [0.0, 1.0]}},  # generation pinned: eval alone
         {"vllm_baseline", "vllm_speculative", "agreement_states", "evaluate_vllm", "summary", "report_figures", "all"}, 0),
        ({"eval": {"latency_prompts": 4}}, {"vllm_baseline", "vllm_speculative", "agreement_states", "evaluate_vllm",
                                            "summary", "report_figures", "all"}, 0),
        ({"eval": {"agreement_standard_errors": 4}}, {"evaluate_vllm", "summary", "report_figures", "all"}, 0),
        ({"eval": {"agreement_tolerance": 0.1}}, {"evaluate_vllm", "summary", "report_figures", "all"}, 0),  # the check alone, no vLLM run
    ],
)
def test_config_changes_plan_exactly_their_stages(workdir, update, reruns, shards):
    edit_config(workdir, update)
    plan = planned(workdir)
    if reruns == "everything":
        # but the prompts and their split: a new target is checked again (engine_start_check) before generation
        assert set(plan) == set(planned(workdir, "-F")) - {"split_prompts"}
    else:
        assert set(plan) == reruns
    assert plan.get("hidden_states", 0) == shards


@pytest.mark.parametrize(
    "update, reruns",
    [
        ({"vllm": {"gpu_memory_utilization": 0.25}}, set()),
        ({"vllm": {"max_num_seqs": 8, "max_num_batched_tokens": 2048}}, set()),
        ({"vllm": {"enforce_eager": False, "attention_backend": "CPU_ATTN", "tensor_parallel_size": 2}}, set()),
        ({"train": {"checkpoint_every": 7}}, set()),
        ({"train": {"num_processes": 2, "device": "cpu"}}, PLAN),  # its memory per process
        ({"hidden_states": {"batch_tokens": 512}}, set()),
        ({"hidden_states": {"device": "cuda", "free_disk_margin_gb": 5}}, PLAN),  # its host RAM; its margin
        ({"train": {"num_workers": 2, "pin_memory": True}}, set()),
        ({"train": {"activation_checkpointing": True, "bf16": True}}, PLAN),  # its training memory
        ({"eval": {"max_tokens_per_batch": 64}}, set()),
        ({"tracking": {"tensorboard": False, "wandb": {"enabled": True, "mode": "offline"},  # observability only
                       "mlflow": {"enabled": True, "tracking_uri": "http://127.0.0.1:9"}}}, set()),
    ],
    ids=lambda update: ",".join(f"{section}.{key}" for section, keys in update.items() for key in keys)
    if isinstance(update, dict) else "",
)
def test_settings_of_speed_or_placement_plan_nothing_but_the_plan(workdir, update, reruns):
    """Where and how fast a stage runs leaves its artifacts as they are (docs/REBUILDING.md):
    only the plan, which is about memory and placement, and the report showing it are redone."""
    edit_config(workdir, update)
    assert set(planned(workdir)) == reruns


def test_engine_settings_that_define_artifacts_still_rebuild(workdir):
    edit_config(workdir, {"vllm": {"kv_cache_dtype": "fp8"}})  # the states of a quantised KV cache
    assert {"generate_part", "generate_responses", "tokenize", "vllm_baseline", "vllm_speculative", "agreement_states",
            "evaluate_vllm"} <= set(planned(workdir))


def test_served_temperatures_regenerate_the_responses_only_when_generation_follows_them(workdir):
    """generate.temperatures null follows eval.temperatures (docs/REBUILDING.md, "Temperatures and
    answers per prompt"): the list it resolved to, written out, plans nothing; then other served temperatures
    leave the responses as they are, and null again takes them: every part is answered again."""
    edit_config(workdir, {"generate": {"temperatures": [0.0, 1.0]}})  # the built run's eval.temperatures
    assert planned(workdir) == {}
    edit_config(workdir, {"eval": {"temperatures": [0.0, 0.5]}})
    assert not {"generate_part", "generate_responses", "tokenize"} & set(planned(workdir))
    edit_config(workdir, {"generate": {"temperatures": None}})
    assert planned(workdir, RAW) == {"generate_part": 4, "generate_responses": 1}  # config.yaml's generate.num_parts


def test_the_fitted_temperature_retrains_only_when_it_resolves_to_another_number(workdir):
    """train.temperature null fits the largest served temperature above 0 (docs/TRAINING.md,
    "Recipe"): the number it resolved to, written out, plans nothing; served temperatures with the
    same largest leave the drafter as it is; another largest retrains it."""
    edit_config(workdir, {"train": {"temperature": 1.0}})  # the built run's eval.temperatures: [0.0, 1.0]
    assert planned(workdir) == {}
    edit_config(workdir, {"train": {"temperature": None}, "eval": {"temperatures": [0.0, 0.5, 1.0]},
                          "generate": {"temperatures": [0.0, 1.0]}})  # generation pinned: the same data
    assert "train_drafter" not in planned(workdir)
    edit_config(workdir, {"eval": {"temperatures": [0.0, 0.5]}})
    assert "train_drafter" in planned(workdir)


def test_another_k_runs_its_drafter_engines_and_nothing_else_in_vllm(workdir):
    """K=2 added to the built run's K=3: its drafter engines alone, one per draft method (the
    baseline's text already reaches K=3 past max_tokens), then the evaluation; a suite added: its
    prompts and every vLLM run."""
    edit_config(workdir, {"eval": {"num_speculative_tokens": [2, 3]}})
    assert planned(workdir) == {"vllm_speculative": 2, "evaluate_vllm": 1, "summary": 1, "report_figures": 1, "all": 1}
    plan = snakemake(workdir, "-n").stdout
    assert "results/eval/vllm_speculative/greedy/K2.json" in plan and "results/eval/vllm_speculative/probabilistic/K2.json" in plan
    edit_config(workdir, {"eval": {"num_speculative_tokens": [3], "suites": [{"name": "tools", "prompts": "resources/demo/eval_tools.jsonl"},
                                                                            {"name": "again", "prompts": "resources/demo/eval_tools.jsonl"}]}})
    assert planned(workdir) == {"eval_prompts": 1, "vllm_baseline": 1, "vllm_speculative": 2, "agreement_states": 1,
                                "evaluate_vllm": 1, "summary": 1, "report_figures": 1, "all": 1}


def test_max_seq_len_reextracts_every_shard_whose_samples_it_cuts(workdir):
    lengths = [len(json.loads(line)["input_ids"]) for line in (workdir / "results/data/tokenized_data.jsonl").open()]
    edit_config(workdir, {"tokenize": {"max_seq_len": min(lengths) - 1}})  # cuts every sample
    before = shard_files(workdir)
    snakemake(workdir, MANIFEST)
    assert changed(before, shard_files(workdir)) == set(before)
    assert all(shard["num_tokens"] == len(shard["sample_ids"]) * (min(lengths) - 1) for shard in manifest(workdir)["shards"])


def test_kill_9_during_extraction_keeps_finished_shards_and_redoes_the_interrupted_one(workdir):
    before = shard_files(workdir)
    log = workdir / "killed_run.log"
    with open(log, "w") as out:  # one job at a time; its own session, so that the kill takes the job too
        run = subprocess.Popen(
            [sys.executable, "-m", "snakemake", MANIFEST, "--cores", "1", "--forcerun", "hidden_states"],
            cwd=workdir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while log.read_text().count("localrule hidden_states:") < 2:  # one shard done, the next running
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    after_kill = shard_files(workdir)
    finished = {name for name in changed(before, after_kill) if name in after_kill}
    interrupted = set(before) - set(after_kill)  # Snakemake removes a job's outputs before it starts
    assert len(finished) == 1 and len(interrupted) == 1, (finished, interrupted)
    hidden = workdir / "results/hidden_states"
    assert not [p.name for p in hidden.iterdir() if p.name.startswith(".")]  # no temporaries

    snakemake(workdir, "--unlock")  # the kill left Snakemake's lock behind (README: after a crash)
    assert planned(workdir, MANIFEST) == {"hidden_states": 1, "hidden_states_manifest": 1}
    snakemake(workdir, MANIFEST)
    after = shard_files(workdir)
    assert {name for name in after if after[name] != after_kill.get(name)} == interrupted
    assert all(after[name][1] == before[name][1] for name in before)  # same bytes as first extracted
    assert planned(workdir, MANIFEST) == {}


def test_a_truncated_shard_is_refused_by_the_manifest_and_reextracted_by_the_next_run(workdir):
    before = shard_files(workdir)
    shard = workdir / "results/hidden_states/shard_00002.safetensors"
    with open(shard, "r+b") as f:  # a partial copy, a full disk: the file is newer and shorter
        f.truncate(shard.stat().st_size // 2)
    result = snakemake(workdir, check=False)  # the manifest reruns on the newer shard and checks it first
    assert result.returncode != 0
    assert f"{shard.relative_to(workdir)}: sha256" in result.stderr and "run snakemake again" in result.stderr
    assert not shard.exists()
    plan = planned(workdir)
    assert plan["hidden_states"] == 1 and {"hidden_states_manifest", "train_drafter", "summary"} <= set(plan)
    snakemake(workdir, str(shard.relative_to(workdir)))
    assert shard_files(workdir)[shard.name][1] == before[shard.name][1]  # the very bytes first extracted


def test_same_size_corruption_is_refused_before_training_and_rebuilt_by_the_next_run(workdir):
    before = shard_files(workdir)
    shard = workdir / "results/hidden_states/shard_00001.safetensors"
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # a flipped bit in the tensor data, size and mtime kept: nothing Snakemake sees
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert planned(workdir, MANIFEST) == {}
    edit_config(workdir, {"train": {"lr": 0.002}})  # training has to run, and reads the shards
    result = snakemake(workdir, "results/train/train_log.tsv", check=False)
    assert result.returncode != 0
    assert f"{shard.relative_to(workdir)}: sha256" in result.stderr and "run snakemake again" in result.stderr
    assert not shard.exists() and not (workdir / "results/train/train_log.tsv").exists()
    plan = planned(workdir)  # training still has to run, so the missing shard is extracted first
    assert plan["hidden_states"] == 1 and {"hidden_states_manifest", "train_drafter"} <= set(plan)
    snakemake(workdir, str(shard.relative_to(workdir)))
    assert shard_files(workdir)[shard.name][1] == before[shard.name][1]
