"""The plan (rule plan, eaglenest.plan) and the disk guard it feeds (eaglenest.states.disk): the
plan's sizes against what the run really wrote and used, and extraction refused on a full disk."""

import collections
import importlib.util
import json
from pathlib import Path

import pytest

from conftest import REPO, edit_config, snakemake
from eaglenest.states import disk
from eaglenest.states.shards import shard_bytes
from eaglenest.train.memory import BETWEEN_STEPS
from eaglenest.workflow.errors import InputError

spec = importlib.util.spec_from_file_location("train_memory_model", REPO / "bench" / "train_memory_model.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

Usage = collections.namedtuple("Usage", "total used free")


def test_planned_hidden_states_bytes_are_within_10_percent_of_the_shards_on_disk(built):
    plan = json.loads((built / "results/plan.json").read_text())
    shards = sorted((built / "results/hidden_states").glob("shard_*.safetensors"))
    on_disk = sum(p.stat().st_size for p in shards)
    assert abs(plan["hidden_states_bytes"] / on_disk - 1) <= 0.10, (plan["hidden_states_bytes"], on_disk)
    manifest = json.loads((built / "results/hidden_states/manifest.json").read_text())
    assert [s["tokens"] for s in plan["shards"]] == [s["num_tokens"] for s in manifest["shards"]]
    report = json.loads((built / "results/data/tokenize_report.json").read_text())
    assert (plan["tokens"], plan["generated_tokens"], plan["samples"]) == (
        report["tokens"], report["generated_tokens"], report["samples_out"])
    assert plan["free_disk_bytes"] > 0
    assert plan["extraction_host_ram_bytes"] > 2 * max(s["bytes"] for s in plan["shards"])  # + the target on CPU
    stages = {s["stage"]: s for s in plan["stages"]}
    assert stages["generate"]["measured"] and stages["generate"]["estimate_s"] > 0  # this run's benchmark files
    markdown = (built / "results/plan.md").read_text()
    assert "# Plan" in markdown and f"{plan['tokens']:,} tokens" in markdown and "estimate" in markdown


def test_a_second_plan_estimates_extraction_and_training_from_the_first_runs_rates(workdir):
    """Replanning after a run: the earlier run's benchmark files and training log give rates."""
    snakemake(workdir, "-f", "plan")
    plan = json.loads((workdir / "results/plan.json").read_text())
    stages = {s["stage"]: s for s in plan["stages"]}
    for stage in ("hidden_states", "train_drafter"):
        assert stages[stage]["rate_source"] == "earlier run in this results folder", stages[stage]
        assert stages[stage]["estimate_s"] == pytest.approx(stages[stage]["work"] / stages[stage]["rate"])
    assert "| hidden_states |" in (workdir / "results/plan.md").read_text()


def bench_train_settings(s):
    """The train: settings of the plan for one of bench/train_memory_model.py's sizes `s` (its
    size_defaults): one micro-batch of its samples, as the bench measures it."""
    return {"max_tokens_per_batch": s["samples"] * s["longest"], "ttt_steps": 3, "device": "cpu",
            "activation_checkpointing": s["checkpointing"], "bf16": s["autocast"], "num_processes": 1,
            "init_from": None, "optimizer": s["optimizer"], "train_lm_head": s["train_lm_head"],
            "tv_weight": s["tv_weight"]}


def test_planned_training_memory_is_within_20_percent_of_the_measured_peak(tmp_path):
    """The plan's figure for a target and config (the drafter it plans: planned_drafter_config),
    against the peak of a real micro-step of that drafter, as bench/train_memory_model.py
    measures it (both sides leave out what the process held before the step)."""
    from eaglenest.plan.plan import training_process_memory

    size = bench.TEST_SIZES[1]  # checkpointed, accumulating: the loop's steady state, which the plan sizes
    s = bench.size_defaults(size)
    bench.write_target(tmp_path, s)
    train = bench_train_settings(s)
    terms, device, autocast = training_process_memory(
        tmp_path, hidden_states={"aux_layer_ids": [1, 4, 6], "dtype": "bfloat16"}, train=train,
        drafter=bench.geometry(s), draft_vocab_size=s["draft_vocab"], longest=s["longest"])
    assert (device, autocast) == ("cpu", s["autocast"])
    held = sum(terms[key] for key in (*BETWEEN_STEPS, "batch_stored")) + terms["gradients"]  # accumulating
    measured = bench.run_measure(size)["bytes"]
    assert abs(measured / (terms["peak"] - held) - 1) <= 0.20, (measured, terms["peak"] - held)


def test_the_plan_sizes_an_mla_drafter_by_its_own_layer(tmp_path):
    """config drafter.layer mla: the plan's training memory is the memory model's for the mla
    drafter (bench.modelled_step, which tests/test_memory_model.py holds to a measured step
    within 2.5%), its weights the mla drafter's, not the gqa drafter's of the same target."""
    from eaglenest.plan.plan import training_process_memory
    from eaglenest.train.memory import parameter_counts

    size = bench.TEST_SIZES[-1]  # mla, checkpointed, accumulating, bf16 autocast, Muon
    s = bench.size_defaults(size)
    bench.write_target(tmp_path, s)
    train = bench_train_settings(s)
    planned = {layer: training_process_memory(
        tmp_path, hidden_states={"aux_layer_ids": [1, 4, 6], "dtype": "bfloat16"}, train=train,
        drafter=geometry, draft_vocab_size=s["draft_vocab"], longest=s["longest"])[0]
        for layer, geometry in (("mla", bench.geometry(s)), ("gqa", bench.geometry(s | {"layer": "gqa"})))}
    terms = planned["mla"]
    assert s["layer"] == "mla" and terms["weights"] == 4 * parameter_counts(bench.drafter_config(s))[0]
    held = sum(terms[key] for key in (*BETWEEN_STEPS, "batch_stored")) + terms["gradients"]  # accumulating
    assert terms["peak"] - held == bench.modelled_step(size)[0]
    assert terms["weights"] != planned["gqa"]["weights"] and terms["peak"] != planned["gqa"]["peak"]


def test_the_guard_sizes_the_shards_not_yet_written_and_names_both_numbers_and_the_folder(tmp_path, monkeypatch):
    parts, shards = tmp_path / "parts", tmp_path / "hidden_states"
    parts.mkdir()
    shards.mkdir()
    (parts / "sizes.json").write_text(json.dumps({"records": [2, 3, 0], "tokens": [100, 200, 0]}))
    (shards / "shard_00000.safetensors").write_bytes(b"written")  # on disk: not needed again
    geometry = dict(hidden_size=1000, dtype="bfloat16", aux_layers=3)
    needed = disk.bytes_to_write(parts, shards, **geometry)
    assert needed == shard_bytes(200, 3, **geometry) + shard_bytes(0, 0, **geometry) == 200 * 8009 + 8 * 4 + 32 + 40  # tokens, offsets, digest; the empty shard
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 3 * 10**9, 3 * 10**9))
    with pytest.raises(InputError) as refused:
        disk.check_free_disk(4 * 10**9, shards, margin_gb=1)
    message = str(refused.value)
    assert str(shards) in message and "3.00 GB free" in message and "5.00 GB extraction needs" in message
    assert "4.00 GB of shards still to write" in message and "hidden_states.free_disk_margin_gb" in message
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: Usage(10**12, 0, 5 * 10**9))
    assert disk.check_free_disk(4 * 10**9, shards / "not_made_yet", margin_gb=1) == 5 * 10**9  # read at its parent


def test_extraction_refuses_to_start_on_a_disk_without_room_and_writes_nothing(workdir):
    """A real run: with a margin no disk has, the shard job fails at once, its log says why in
    one line, no shard is written, and the shards already there stay."""
    shard = workdir / "results/hidden_states/shard_00001.safetensors"
    others = {p: p.stat().st_mtime_ns for p in shard.parent.glob("shard_*.safetensors") if p != shard}
    shard.unlink()
    edit_config(workdir, {"hidden_states": {"free_disk_margin_gb": 10**9}})  # an exabyte
    result = snakemake(workdir, str(shard.relative_to(workdir)), check=False)
    assert result.returncode != 0 and not shard.exists()
    log = (workdir / "results/logs/hidden_states/shard_00001.log").read_text()
    line = next(line for line in log.splitlines() if "GB free, below the" in line)
    assert str(Path(workdir / "results/hidden_states")) in line and "hidden_states.free_disk_margin_gb" in line
    assert "Traceback" not in log
    assert {p: p.stat().st_mtime_ns for p in others} == others


def test_sizes_and_times_read_the_same_in_the_plan_the_report_and_the_guard():
    """One unit system for people (docs/ARCHITECTURE.md "Units for people"): decimal bytes, h:mm:ss."""
    from eaglenest.report.common import DASH, duration as report_duration, size as report_size
    from eaglenest.workflow.units import duration, size

    assert [size(n) for n in (512, 3 * 10**6, 10**9, 1.2 * 10**12)] == ["512 B", "3.0 MB", "1.00 GB", "1.20 TB"]
    assert [duration(s) for s in (31.46, 82, 3725)] == ["31.5 s", "0:01:22", "1:02:05"]
    assert (report_size(10**9), report_duration(82), report_size(None), report_duration(None)) == ("1.00 GB", "0:01:22",
                                                                                                  DASH, DASH)
