"""profiles/slurm on a real two-node SLURM cluster (tests/slurm_cluster.py: slurmctld, a slurmd per
node and munge on this machine): jobs go through sbatch, a job cancelled while it runs is rerun alone, and
the artifacts are byte-identical to a local run's. The CPU stages from the responses to the token
counts; then, on a few samples, train_drafter on both nodes and the GPU stage hidden_states (vLLM on
CPU) grouped into one allocation, each against a local run (docs/GPUS.md)."""

import hashlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors import safe_open

from conftest import DEMO_RAW, REPO, edit_config, merge, new_workdir, snakemake
from slurm_cluster import NODES, LocalSlurm, alive, node_share
from test_profiles import CLUSTER_PYTHON

TARGETS = ["results/data/tokenized_data.jsonl", "results/data/token_freq.pt"]
OUTPUTS = ["results/data/tokenized_data.jsonl", "results/data/tokenize_report.json", "results/data/token_freq.pt"]
RULES = {"tokenize": 1, "token_freq": 1}
CANCELLED = "tokenize"  # scancel'ed while it runs: retries: 1 reruns it


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The cluster, started once for the session and stopped (every daemon, by pid) after it."""
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    pids = cluster.pids()
    yield cluster
    cluster.stop()
    assert not [name for name, pid in pids.items() if alive(pid)], "a daemon outlived stop()"


def local_profile(folder):
    """profiles/slurm fitted to the cluster, as docs/GPUS.md tells a small cluster's user:
    its partitions and GPU model as they are; memory, CPUs and threads within a node; job
    states from squeue (no accounting daemon); status checks every second (the plugin's default
    40 s is for a busy scheduler); SLURM logs kept for the checks below."""
    settings = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    node = node_share()
    mem_mb = node["RealMemory"] // 8
    settings["default-resources"] = [f"mem_mb={mem_mb}" if r.startswith("mem_mb=") else r
                                     for r in settings["default-resources"]]
    for resources in settings["set-resources"].values():
        resources |= {key: value for key, value in {"mem_mb": mem_mb, "cpus_per_gpu": 1}.items() if key in resources}
    settings["set-threads"] = {rule: node["CPUs"] for rule in settings["set-threads"]}
    settings |= {"slurm-status-command": "squeue", "slurm-init-seconds-before-status-checks": 1,
                 "seconds-between-status-checks": 1, "slurm-keep-successful-logs": True,
                 "slurm-no-account": True}  # no accounting: nothing to guess it from
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(settings))
    return folder


def small_workflow(folder, target):
    """A workflow copy that starts from the demo's responses and the session's demo target."""
    workdir = new_workdir(folder)
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["data"]["raw_responses"] = str(DEMO_RAW)
    config["target"] |= {"demo": False, "path": str(target)}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    return workdir


def digests(workdir):
    return {path: hashlib.sha256((workdir / path).read_bytes()).hexdigest() for path in OUTPUTS}


@pytest.fixture(scope="module")
def slurm_run(slurm, demo_target, tmp_path_factory):
    """The run through sbatch, with `tokenize` cancelled by scancel once it runs. -> (workdir, its
    Snakemake output, {SLURM job id: (rule, scontrol's record of the job)})."""
    root = tmp_path_factory.mktemp("slurm_run")
    workdir = small_workflow(root, demo_target)
    profile = local_profile(root / "profile")
    run = subprocess.Popen([CLUSTER_PYTHON, "-m", "snakemake", "--profile", profile, *TARGETS], cwd=workdir,
                           env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cancelled = cancel_when_running(slurm, CANCELLED)
        output = run.communicate(timeout=600)[0]
    finally:
        run.kill()
    assert run.returncode == 0, output
    jobs = {}
    for job_id, rule in re.findall(r"has been submitted with SLURM jobid (\d+) \(log: .*?/rule_(\w+)/", output):
        jobs[job_id] = (rule, slurm.run("scontrol", "show", "job", job_id))
    return workdir, output, jobs, cancelled


def cancel_when_running(slurm, rule, timeout_s=300):
    """scancel the first SLURM job of `rule` once it runs -> its job id."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job_id in slurm.run("squeue", "--noheader", "--states=running", "--format=%i").split():
            if f"rule_{rule}" in slurm.run("scontrol", "show", "job", job_id):
                time.sleep(3)  # the job's own Snakemake is under way
                slurm.run("scancel", job_id)
                return job_id
        time.sleep(0.5)
    raise TimeoutError(f"no running {rule} job in {timeout_s} s")


def field(record, name):
    return re.search(rf"\b{name}=(\S*)", record)[1]


def test_every_job_is_a_slurm_job_on_the_profiles_partition_with_its_log(slurm_run):
    workdir, output, jobs, cancelled = slurm_run
    assert sorted(rule for rule, _ in jobs.values()) == sorted([*RULES, CANCELLED])  # the cancelled one twice
    for job_id, (rule, record) in jobs.items():
        assert field(record, "JobState") == ("CANCELLED" if job_id == cancelled else "COMPLETED"), record
        assert field(record, "Partition") == "cpu"  # default-resources: the CPU stages
        assert field(record, "TimeLimit") == "01:00:00"  # runtime=60 minutes
        log = workdir / f".snakemake/slurm_logs/rule_{rule}/{job_id}.log"  # where docs/GPUS.md says
        assert field(record, "StdOut") == str(log) and log.exists()
    assert "TresPerJob" not in "".join(record for _, record in jobs.values())  # no GPU asked for a CPU stage


def test_a_cancelled_job_is_rerun_alone(slurm_run):
    workdir, output, jobs, cancelled = slurm_run
    assert f"SLURM-job '{cancelled}' failed, SLURM status is: 'CANCELLED'" in output
    assert output.count("Trying to restart job") == 1
    assert "Nothing to be done" in snakemake(workdir, "-n", *TARGETS).stdout  # every output whole and up to date


def test_artifacts_are_those_of_a_local_run(slurm_run, tmp_path):
    workdir, *_ = slurm_run
    local = tmp_path / "local"
    shutil.copytree(workdir, local, symlinks=True, ignore=shutil.ignore_patterns("results", ".snakemake"))
    snakemake(local, *TARGETS)
    assert digests(local) == digests(workdir)



# Multi-node training and the extraction shards grouped into one allocation (docs/GPUS.md), each on
# a few of the demo's responses: what is checked is where the jobs ran, and that the artifacts are
# those of a local run, which runs beside the cluster's from a copy of the same workflow.
SAMPLES = 48  # the demo's first responses: 43 samples after tokenize, 5 optimizer steps of one epoch
MANIFEST, D2T, T2D, DRAFTER = (f"results/{path}" for path in ("hidden_states/manifest.json", "vocab/d2t.pt",
                                                                "vocab/t2d.pt", "drafter"))
MULTI_NODE = {"nodes": 2, "tasks": 2, "tasks_per_gpu": 0, "mpi": "srun"}  # docs/GPUS.md's lines for train_drafter
SHARDS = [f"results/hidden_states/shard_{i:05d}.safetensors" for i in range(2)]
# docs/GPUS.md "The shards of a phase in one allocation": the shards in one sbatch job of one shard's resources
GROUPED = {
    "groups": ["hidden_states=extract"], "group-components": [f"extract={len(SHARDS)}"],
    "resources": ["engine=1"], "set-resource-scopes": ["engine=local"],
}


def tiny_workflow(folder, target, update):
    """small_workflow on the demo's first SAMPLES responses, with `update` in its config."""
    folder.mkdir()
    workdir = small_workflow(folder, target)
    raw = folder / "raw_responses.jsonl"
    raw.write_text("".join(DEMO_RAW.read_text().splitlines(keepends=True)[:SAMPLES]))
    edit_config(workdir, merge({"data": {"raw_responses": str(raw)}}, update))
    return workdir


def fitted_profile(folder, rule, resources, drop=(), settings=None):
    """local_profile with `resources` set for `rule`, its `drop` resources removed, `settings` added."""
    path = local_profile(folder) / "config.yaml"
    profile = yaml.safe_load(path.read_text())
    for name in drop:
        del profile["set-resources"][rule][name]
    profile["set-resources"][rule] |= resources
    path.write_text(yaml.safe_dump(profile | (settings or {})))
    return folder


def beside_local_run(slurm, workdir, profile, *targets):
    """Snakemake with `profile` in `workdir`, and at the same time a local run of the same targets
    on the cores of all nodes together, in a copy of `workdir` (its results and Snakemake's records
    of them: the same jobs are left to run). -> (the copy, {SLURM job id: scontrol's record of it})"""
    local, log = workdir.parent / "local", workdir.parent / "local.log"
    shutil.copytree(workdir, local, symlinks=True)
    cores = str(len(NODES) * node_share()["CPUs"])
    with open(log, "w") as out, subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", cores, *targets],
                                                 cwd=local, stdout=out, stderr=subprocess.STDOUT) as twin:
        run = subprocess.run([CLUSTER_PYTHON, "-m", "snakemake", "--profile", profile, *targets], cwd=workdir,
                             env=slurm.env, capture_output=True, text=True, timeout=600)
    assert twin.returncode == 0, log.read_text()
    assert run.returncode == 0, run.stdout + run.stderr
    return local, {job_id: slurm.run("scontrol", "show", "job", job_id)
                   for job_id in re.findall(r"has been submitted with SLURM jobid (\d+)", run.stdout + run.stderr)}


def step_tasks(slurm, step):
    """{node: [task ids]} that slurmd of each node started for `step` ("<job>.<step>"), from its log."""
    return {node: re.findall(rf"\[{re.escape(step)}\] task (\d+) \(\d+\) started", log.read_text())
            for node, log in ((node, slurm.folder / f"slurmd-{node}.log") for node in NODES)}


@pytest.fixture(scope="module")
def multi_node(slurm, demo_target, tmp_path_factory):
    """train_drafter with train.num_processes 2 on CPU through sbatch, with docs/GPUS.md's multi-node
    lines (and no gpu_model: a rule of 0 GPUs must not keep one, as the docs say), from the shards of
    a local run. -> (its workdir, the local run's, the SLURM job's id, scontrol's record of it)"""
    workdir = tiny_workflow(tmp_path_factory.mktemp("multi_node") / "slurm", demo_target,
                            {"hidden_states": {"num_shards": 2},
                             "train": {"device": "cpu", "num_processes": 2, "epochs": 1}})
    snakemake(workdir, MANIFEST, D2T, T2D)  # everything training reads
    profile = fitted_profile(workdir.parent / "profile", "train_drafter", MULTI_NODE,
                             drop=("gpu_model", "cpus_per_gpu"))
    local, jobs = beside_local_run(slurm, workdir, profile, DRAFTER)
    [(job_id, record)] = jobs.items()
    return workdir, local, job_id, record


def test_multi_node_training_runs_a_torchrun_on_each_node(slurm, multi_node):
    """The job held both nodes, a task and a CPU on each (set-threads: a node's CPUs); in it srun
    started one torchrun on each node (one task of the step in each slurmd's log), each with one
    DDP process (--nproc-per-node=1), meeting at the batch host (its hostname: both nodes are this
    machine) under the job's id: rank 0 trained with 2 processes."""
    workdir, _, job_id, record = multi_node
    assert field(record, "JobState") == "COMPLETED" and field(record, "Partition") == "gpu"
    assert [field(record, name) for name in ("NodeList", "NumNodes", "NumTasks", "CPUs/Task", "BatchHost")] == [
        "n[1-2]", "2", "2", str(node_share()["CPUs"]), "n1"]
    assert step_tasks(slurm, f"{job_id}.0") == {"n1": ["0"], "n2": ["1"]}  # the job's first step: srun's torchruns
    log = (workdir / "results/logs/train_drafter.log").read_text()
    assert (f"launching 1 processes on each of 2 nodes: srun {CLUSTER_PYTHON} -m torch.distributed.run --nnodes=2 "
            f"--rdzv-backend=c10d --rdzv-endpoint={socket.gethostname()}:29500 --rdzv-id={job_id} "
            "--nproc-per-node=1 ") in log
    assert "device cpu, 2 processes" in log


def test_multi_node_training_trains_what_one_node_does(multi_node):
    """docs/GPUS.md: the number of nodes is not part of what training computes. 2 processes on 2
    nodes train, tensor for tensor, the drafter of 2 on one node with the threads of both."""
    workdir, local, *_ = multi_node
    trained, expected = tensors(workdir / DRAFTER), tensors(local / DRAFTER)
    assert trained.keys() == expected.keys()
    assert all(torch.equal(trained[name], expected[name]) for name in expected)
    assert (workdir / DRAFTER / "config.json").read_text() == (local / DRAFTER / "config.json").read_text()


def tensors(drafter):
    with safe_open(drafter / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def grouped_extraction(slurm, demo_target, tmp_path_factory):
    """The vLLM backend's shards (the rule asks a GPU: hidden_states.device cuda; vLLM here is its
    CPU build) through sbatch in one group, from a local split of the samples.
    -> (its workdir, the local run's, {SLURM job id: scontrol's record})"""
    workdir = tiny_workflow(tmp_path_factory.mktemp("grouped") / "slurm", demo_target,
                            {"hidden_states": {"backend": "vllm", "device": "cuda", "num_shards": len(SHARDS)},
                             # speed only: a KV cache of 0.5 GB, made in 0.3 s, not the default's 4 GB in 8 s
                             "vllm": {"gpu_memory_utilization": 0.05}})
    snakemake(workdir, "results/data/shards")
    # vLLM's engine takes its share of the RAM (vllm.gpu_memory_utilization): the job asks a node's
    profile = fitted_profile(workdir.parent / "profile", "hidden_states",
                             {"engine": 1, "mem_mb": node_share()["RealMemory"]}, settings=GROUPED)
    local, jobs = beside_local_run(slurm, workdir, profile, *SHARDS)
    return workdir, local, jobs


def test_a_group_of_shards_is_one_allocation_with_its_gpus(slurm, grouped_extraction):
    """One sbatch job holds both shards, on partition gpu with one shard's GPU (the layers of
    resources engine=1: not one GPU per shard) and their runtimes added up; in it each shard is a
    step of its own (the jobstep executor's srun)."""
    workdir, _, jobs = grouped_extraction
    [(job_id, record)] = jobs.items()
    assert field(record, "JobState") == "COMPLETED" and field(record, "Partition") == "gpu"
    assert field(record, "TresPerJob") == "gres:gpu:rtx_pro_6000:1"
    assert field(record, "TimeLimit") == "12:00:00"  # 2 x the profile's 360 min
    assert field(record, "StdOut") == str(workdir / f".snakemake/slurm_logs/group_extract_hidden_states/{job_id}.log")
    node = field(record, "NodeList")
    assert [step_tasks(slurm, f"{job_id}.{step}")[node] for step in range(len(SHARDS))] == [["0"]] * len(SHARDS)


def test_a_group_loads_the_target_once_per_shard_not_once(grouped_extraction):
    """docs/GPUS.md: the group's Snakemake runs each shard in a Snakemake of its own (the SLURM
    plugin passes no group to it), and an engine service belongs to one Snakemake process: each
    shard job starts a service and loads the target."""
    workdir, *_ = grouped_extraction
    assert (workdir / "results/logs/hidden_states/engine.log").read_text().count("target loaded in") == len(SHARDS)
    for shard in range(len(SHARDS)):
        assert "started the hidden_states engine service" in (
            workdir / f"results/logs/hidden_states/shard_{shard:05d}.log").read_text()


def test_grouped_shards_are_those_of_a_local_run(grouped_extraction):
    """Byte for byte the shards of one engine in a local run."""
    workdir, local, _ = grouped_extraction
    assert all((workdir / shard).read_bytes() == (local / shard).read_bytes() for shard in SHARDS)
