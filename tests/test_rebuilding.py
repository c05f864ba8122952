"""The README's "Rebuilding" commands run as it gives them, and code edits planned down to the rules
that import the module: real Snakemake runs on a built workflow copy (split from
test_incremental.py so that the two files run on two workers)."""

import hashlib
import json
import re

import pytest
import yaml

from conftest import FAST_PROMPTS, REPO, edit_config, jobs_run, mtimes, planned, snakemake
from eaglenest.workflow.parts import part_of
from test_incremental import DOWNSTREAM_OF_TRAINING, MANIFEST, NEW_STATES, NUM_SHARDS, changed, shard_files

NUM_PARTS = yaml.safe_load((REPO / "config.yaml").read_text())["generate"]["num_parts"]


def results_changed(before, after):
    """The result files (logs aside) that a run rewrote, added or removed, from two conftest.mtimes."""
    return {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}


def benchmark(shard):
    """The benchmark file (wall time, peak RSS) that the job of `shard` writes beside it."""
    return f"results/benchmarks/hidden_states/{shard.replace('.safetensors', '.tsv')}"


def digest(workdir, paths):
    return {path: hashlib.sha256((workdir / path).read_bytes()).hexdigest() for path in paths}


def test_readme_rebuilding_names_the_commands_its_tests_run():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Rebuilding"):]
    section = section[: section.index("\n## ", 3)]
    for command in [
        "snakemake -n",
        "snakemake shard_samples",
        "snakemake split_prompts",
        "snakemake -f results/vocab/d2t.pt",
        "snakemake -f results/hidden_states/shard_00001.safetensors",
        "snakemake -R hidden_states",
        f"snakemake {MANIFEST} -R hidden_states",
        "snakemake --touch",
        "snakemake --unlock",
    ]:
        assert f"`{command}`" in section, command


def test_readme_what_is_stale_and_why_then_a_cosmetic_change_touched(workdir):
    edit_config(workdir, {"train": {"lr": 0.002}})
    dry = snakemake(workdir, "-n").stdout
    train_job = dry[dry.index("rule train_drafter:"):]
    assert "reason: Params have changed since last execution" in train_job[: train_job.index("\n\n")]
    edit_config(workdir, {"train": {"lr": 0.003}})
    assert planned(workdir) == {}

    # touch after a cosmetic change: a reformatted script is seen as changed code, --touch says it is not
    script = workdir / "scripts/summary.py"
    script.write_text(script.read_text().replace("run_stage(", "run_stage(  # reformatted", 1))
    assert set(planned(workdir)) >= {"summary"}
    summary = (workdir / "results/summary.md").read_text()
    snakemake(workdir, "--touch")
    assert planned(workdir) == {} and (workdir / "results/summary.md").read_text() == summary


def test_readme_split_prompts_then_dry_run_names_exactly_the_parts_to_generate(workdir):
    """Appended prompts that go to part 1: `snakemake split_prompts` runs the split alone, which
    rewrites the parts' folder (Snakemake clears a job's outputs) with new bytes in part 1 alone;
    `snakemake -n` then plans the generation of part 1 alone (the merge and what follows it too)."""
    prompts = workdir / "resources/demo/prompts.jsonl"
    unused = (REPO / "resources/demo/prompts.jsonl").read_text().splitlines(keepends=True)[FAST_PROMPTS:]
    appended = [line for line in unused if part_of(json.loads(line)["id"], NUM_PARTS) == 1][:2]
    prompts.write_text(prompts.read_text() + "".join(appended))
    split = "results/responses/prompts"
    before, parts = mtimes(workdir), sorted(str(p.relative_to(workdir)) for p in (workdir / split).glob("part_*"))
    hashes = digest(workdir, parts)
    assert jobs_run(snakemake(workdir, "split_prompts")) == {"split_prompts": 1}
    assert {path for path in results_changed(before, mtimes(workdir)) if not path.startswith(f"{split}/")} == set()
    after = digest(workdir, parts)
    assert {path for path in parts if after[path] != hashes[path]} == {f"{split}/part_00001.jsonl", f"{split}/part_00001.sha256"}
    assert (workdir / split / "part_00001.jsonl").read_text().endswith("".join(appended))
    dry = snakemake(workdir, "-n").stdout
    assert planned(workdir)["generate_part"] == 1
    assert re.findall(r"output: results/responses/parts/(part_\d{5}\.jsonl)", dry) == ["part_00001.jsonl"]
    assert f"reason: Updated input files: {split}/part_00001.sha256" in dry


def test_readme_regenerate_one_artifact_then_one_shard_runs_only_their_jobs(workdir):
    """`-f` a file: its job alone runs, and writes the same bytes (every stage is deterministic on
    CPU); no other result file is touched. The vocabulary's files are small enough for Snakemake to
    compare by checksum: the same bytes leave nothing stale downstream."""
    vocab = ["results/vocab/d2t.pt", "results/vocab/t2d.pt", "results/vocab/coverage.json"]
    before, hashes = mtimes(workdir), digest(workdir, vocab)
    assert jobs_run(snakemake(workdir, "-f", "results/vocab/d2t.pt")) == {"vocab_map": 1}
    assert results_changed(before, mtimes(workdir)) == set(vocab) and digest(workdir, vocab) == hashes
    assert planned(workdir) == {}

    shard = "shard_00001.safetensors"
    before, shards = mtimes(workdir), shard_files(workdir)
    assert jobs_run(snakemake(workdir, "-f", f"results/hidden_states/{shard}")) == {"hidden_states": 1}
    assert results_changed(before, mtimes(workdir)) == {f"results/hidden_states/{shard}", benchmark(shard)}
    assert changed(shards, shard_files(workdir)) == {shard} and shard_files(workdir)[shard][1] == shards[shard][1]


def test_readme_force_a_stage_and_everything_downstream(workdir):
    """`-R hidden_states` plans every shard and all that follows them, nothing upstream; run up to
    the manifest (past it, training and every vLLM engine would run again: minutes of CI), it
    re-extracts every shard, to the same bytes, and rewrites the manifest, and touches nothing else."""
    plan = planned(workdir, "-R", "hidden_states")
    assert set(plan) == {"hidden_states", "hidden_states_manifest"} | DOWNSTREAM_OF_TRAINING | NEW_STATES
    assert plan["hidden_states"] == NUM_SHARDS
    before, shards = mtimes(workdir), shard_files(workdir)
    # the target first: -R takes every word after it as a rule (docs/SNAKEMAKE.md)
    assert jobs_run(snakemake(workdir, MANIFEST, "-R", "hidden_states")) == {"hidden_states": NUM_SHARDS,
                                                                              "hidden_states_manifest": 1}
    assert results_changed(before, mtimes(workdir)) == {path for name in shards
                                                        for path in (f"results/hidden_states/{name}", benchmark(name))} | {MANIFEST}
    after = shard_files(workdir)
    assert changed(shards, after) == set(shards) and all(after[name][1] == shards[name][1] for name in shards)


@pytest.mark.parametrize(
    "module, reruns",
    [
        ("data/vocab.py", {"token_freq", "vocab_map"} | DOWNSTREAM_OF_TRAINING),
        ("evaluate/summary.py", {"summary", "report_figures", "all"}),  # the report words its counts with it
        ("plan/rates.py", {"plan", "report_figures", "all"}),  # the report's stages table reads benchmark files with it
        ("demo/data.py", set()),  # builds resources/demo; no rule imports it
    ],
)
def test_a_code_edit_plans_the_rules_that_import_the_module_and_their_downstream(workdir, module, reruns):
    path = workdir / "eaglenest" / module
    path.write_text(path.read_text() + "\n\ndef edited():\n    return 1\n")
    assert set(planned(workdir)) == reruns
