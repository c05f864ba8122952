"""profiles/slurm on a real two-node SLURM cluster (tests/slurm_cluster.py: slurmctld, a slurmd per
node and munge on this machine), and the faults a cluster run meets. The CPU stages from the
responses to the token counts: a job cancelled while it runs is rerun alone; Snakemake killed
mid-run, then run again as docs/CLUSTERS.md says, submits only the unfinished job; a job over its
memory or its time is killed by the scheduler, which says why; the artifacts are byte-identical to
a local run's. Then, on a few samples, train_drafter on both nodes, and the GPU stage hidden_states
(vLLM on CPU) across two allocations of a node each by `make slurm-phase`'s command, one target load
each, with an allocation cancelled and the command killed, each against a local run (docs/CLUSTERS.md)."""

import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from conftest import DEMO_RAW, REPO, edit_config, merge, new_workdir, snakemake
from slurm_cluster import GPU_MODEL, NODES, SYSTEM_CONF, LocalSlurm, alive, node_share
from test_profiles import CLUSTER_PYTHON

TARGETS = ["results/data/tokenized_data.jsonl", "results/data/token_freq.pt"]
TOKENIZED = ["results/data/tokenized_data.jsonl", "results/data/tokenize_report.json"]  # tokenize's outputs
OUTPUTS = [*TOKENIZED, "results/data/token_freq.pt"]
SUBMITTED = re.compile(r"has been submitted with SLURM jobid (\d+) \(log: .*?/rule_(\w+)/")
TOKENIZE_MEM_MB = 100  # the fault below: the job's own Snakemake alone holds ~170 MB
OTHER_SESSION_S = 900  # how long a session waits for another's cluster (its test_slurm.py takes ~7 min)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The cluster, started once for the session and stopped (every daemon, by pid) after it."""
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start(owner=os.getpid(), wait_s=OTHER_SESSION_S)
    pids = cluster.pids()
    yield cluster
    cluster.stop()
    assert not [name for name, pid in pids.items() if alive(pid)], "a daemon outlived stop()"


def local_profile(folder):
    """profiles/slurm fitted to the cluster, as docs/CLUSTERS.md tells a small cluster's user:
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
                 "seconds-between-status-checks": 1, "slurm-keep-successful-logs": True}
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


def stamps(workdir, paths):
    """{path: (sha256, mtime in ns)}: what a rerun must not touch."""
    return {path: (hashlib.sha256((workdir / path).read_bytes()).hexdigest(), (workdir / path).stat().st_mtime_ns)
            for path in paths}


@pytest.fixture(scope="module")
def runs(slurm, demo_target, tmp_path_factory):
    """Every scenario below side by side, each in a workflow copy of its own, and the local run they
    are compared with. The hung job goes first: its minute, and the plugin's status checks, which
    slow down while nothing finishes (docs/CLUSTERS.md), are the longest wait, and the rest runs beside
    it. -> {scenario: its future}: a test takes its own scenario's result only."""
    profile = local_profile(tmp_path_factory.mktemp("profile") / "slurm")
    copy = lambda name: small_workflow(tmp_path_factory.mktemp(name), demo_target)  # noqa: E731
    timeout = copy("timeout")
    run, hung = hung_run(slurm, timeout, profile)
    with ThreadPoolExecutor(5) as pool:  # leaving it waits for every scenario
        futures = {"timeout": pool.submit(lambda: (timeout, *finished(run), hung)),
                   "cancelled": pool.submit(cancelled, slurm, copy("cancelled"), profile),
                   "killed": pool.submit(killed, slurm, copy("killed"), profile),
                   "memory": pool.submit(out_of_memory, slurm, copy("memory"), profile),
                   "local": pool.submit(local_digests, copy("local"))}
    return futures


def on_cluster(slurm, workdir, profile, *args):
    """The cluster venv's Snakemake with the profile, started in `workdir`."""
    return subprocess.Popen([CLUSTER_PYTHON, "-m", "snakemake", "--profile", profile, *args], cwd=workdir,
                            env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(run, timeout_s=600):
    """Wait for the Snakemake `run` -> (its exit status, its output)."""
    try:
        output = run.communicate(timeout=timeout_s)[0]
    finally:
        run.kill()
    return run.returncode, output


def slurm_jobs(slurm, workdir):
    """{job id: (rule, state)} of the jobs from `workdir` that slurmctld still holds (finished ones
    for MinJobAge, 300 s). The plugin gives each job the comment rule_<rule>."""
    listing = slurm.run("squeue", "--noheader", "--states=all", "--format=%i|%k|%T|%Z")
    rows = (line.split("|") for line in listing.splitlines())
    return {job: (comment.removeprefix("rule_"), state) for job, comment, state, folder in rows
            if folder == str(workdir)}


def running_job(slurm, workdir, rule, timeout_s=300):
    """The id of `rule`'s SLURM job from `workdir`, once it runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job, (job_rule, state) in slurm_jobs(slurm, workdir).items():
            if (job_rule, state) == (rule, "RUNNING"):
                return job
        time.sleep(0.5)
    raise TimeoutError(f"no running {rule} job from {workdir} in {timeout_s} s")


def wait_until(done, what, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s} s")
        time.sleep(0.5)


def cancelled(slurm, workdir, profile):
    """`tokenize` cancelled by scancel once it runs; the profile's retries: 1 reruns it.
    -> (workdir, Snakemake's output, {SLURM job id: (rule, scontrol's record of the job)}, the cancelled id)"""
    run = on_cluster(slurm, workdir, profile, *TARGETS)
    job = running_job(slurm, workdir, "tokenize")
    time.sleep(3)  # the job's own Snakemake is under way
    slurm.run("scancel", job)
    returncode, output = finished(run)
    assert returncode == 0, output
    records = {job_id: (rule, slurm.run("scontrol", "show", "job", job_id))
               for job_id, rule in SUBMITTED.findall(output)}
    return workdir, output, records, job


def killed(slurm, workdir, profile):
    """Snakemake SIGKILLed while `token_freq` runs (`tokenize` is done), then what docs/CLUSTERS.md tells
    the user to do: cancel the killed run's jobs by its run ID (in its log), wait until they are
    gone, `--unlock`, run again. -> what each step left, by name."""
    run = on_cluster(slurm, workdir, profile, *TARGETS)
    running_job(slurm, workdir, "token_freq")
    at_kill = sorted(slurm_jobs(slurm, workdir).values())
    tokenized = stamps(workdir, TOKENIZED)
    run.kill()
    finished(run)
    (log,) = (workdir / ".snakemake/log").glob("*.snakemake.log")
    run_id = re.search(r"SLURM run ID: (\S+)", log.read_text())[1]
    slurm.run("scancel", "--name", run_id)
    wait_until(lambda: not slurm.run("squeue", "--noheader", "--name", run_id), f"{run_id}'s jobs gone")
    refused = finished(on_cluster(slurm, workdir, profile, *TARGETS))
    unlocked = finished(on_cluster(slurm, workdir, profile, "--unlock"))
    rerun = finished(on_cluster(slurm, workdir, profile, *TARGETS))
    return {"workdir": workdir, "at_kill": at_kill, "tokenized": tokenized, "refused": refused, "unlocked": unlocked,
            "rerun": rerun, "tokenized_after": stamps(workdir, TOKENIZED)}


def hung_run(slurm, workdir, profile):
    """`tokenize` given a minute, hung once it runs (every process of the job stopped, as a stuck
    file system or collective would hold it), no retry: SLURM ends it at its time limit.
    -> (the Snakemake run, still going, the job id)"""
    run = on_cluster(slurm, workdir, profile, "--set-resources", "tokenize:runtime=1", "--retries", "0", TOKENIZED[0])
    try:
        job = running_job(slurm, workdir, "tokenize")
        hang(slurm, job)
    except BaseException:
        run.kill()
        raise
    return run, job


def job_environment(pid, job):
    """Whether process `pid` runs in SLURM job `job` (its environment says so)."""
    try:
        return f"SLURM_JOB_ID={job}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


def hang(slurm, job):
    """SIGSTOP every process of `job` (scontrol listpids), until it has no other. Only those whose
    environment names the job: on this shared machine a run of the suite once stopped processes of
    other sessions (tool shells, other runs) and the cluster's own daemons, all listed as the job's."""
    stopped, deadline = set(), time.monotonic() + 60
    while True:
        try:
            listed = slurm.run("scontrol", "listpids", job)
        except RuntimeError:  # "does not exist on node": its step not launched there yet, or over
            if stopped or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
            continue
        pids = {int(line.split()[0]) for line in listed.splitlines()[1:]}
        pids = {pid for pid in pids if job_environment(pid, job)}
        if stopped and pids <= stopped:
            return
        for pid in pids - stopped:
            with contextlib.suppress(ProcessLookupError):  # a short-lived child, gone already
                os.kill(pid, signal.SIGSTOP)
        stopped |= pids
        time.sleep(0.1)


def out_of_memory(slurm, workdir, profile):
    """`tokenize` given TOKENIZE_MEM_MB by a profile override, no retry.
    -> (workdir, Snakemake's exit status and output)"""
    run = on_cluster(slurm, workdir, profile, "--set-resources", f"tokenize:mem_mb={TOKENIZE_MEM_MB}",
                     "--retries", "0", TOKENIZED[0])
    return workdir, *finished(run)


def local_digests(workdir):
    """The targets run locally (--cores 2): the artifacts every cluster run is held to."""
    snakemake(workdir, *TARGETS)
    return digests(workdir)


def field(record, name):
    return re.search(rf"\b{name}=(\S*)", record)[1]


def test_the_cluster_stops_with_slurmctld_dead_and_starts_again_in_its_folder(slurm, tmp_path):
    """`make slurm-stop` after slurmctld died stops every daemon and removes the /etc link;
    `make slurm-start` on the stopped folder starts it afresh. A second cluster is refused while
    the session's owner lives, and the cluster of a killed session (daemons running, the link
    taken, its owner dead) is stopped by the next start. First in the file: the session's
    cluster, started again, serves the tests below."""
    refusal = f"links to the cluster in {slurm.folder}, which runs for process {os.getpid()}"
    with pytest.raises(RuntimeError, match=refusal):
        LocalSlurm(tmp_path / "second").start()
    before = slurm.pids()
    os.kill(before["slurmctld"], signal.SIGKILL)
    while alive(before["slurmctld"]):
        time.sleep(0.1)
    slurm.stop()
    assert not [name for name, pid in before.items() if alive(pid)] and not SYSTEM_CONF.is_symlink()

    killed = LocalSlurm(tmp_path / "killed_session")
    session = subprocess.run([sys.executable, "-c", "import os, signal, slurm_cluster\n"
                              f"slurm_cluster.LocalSlurm({str(killed.folder)!r}).start(owner=os.getpid())\n"
                              "os.kill(os.getpid(), signal.SIGKILL)"], cwd=REPO / "tests")
    assert session.returncode == -signal.SIGKILL and SYSTEM_CONF.resolve() == killed.conf
    orphans = killed.pids()
    assert set(orphans) == set(before) and all(alive(pid) for pid in orphans.values())

    slurm.start(owner=os.getpid())
    assert not [name for name, pid in orphans.items() if alive(pid)]
    assert slurm.idle() and SYSTEM_CONF.resolve() == slurm.conf
    assert set(slurm.pids()) == set(before) and not set(slurm.pids().values()) & set(before.values())


def test_every_job_is_a_slurm_job_on_the_profiles_partition_with_its_log(runs):
    workdir, output, jobs, cancelled_id = runs["cancelled"].result()
    assert sorted(rule for rule, _ in jobs.values()) == ["token_freq", "tokenize", "tokenize"]  # tokenize rerun
    for job_id, (rule, record) in jobs.items():
        assert field(record, "JobState") == ("CANCELLED" if job_id == cancelled_id else "COMPLETED"), record
        assert field(record, "Partition") == "cpu"  # default-resources: the CPU stages
        assert field(record, "TimeLimit") == "01:00:00"  # runtime=60 minutes
        log = workdir / f".snakemake/slurm_logs/rule_{rule}/{job_id}.log"  # where docs/CLUSTERS.md says
        assert field(record, "StdOut") == str(log) and log.exists()
    assert "TresPerJob" not in "".join(record for _, record in jobs.values())  # no GPU asked for a CPU stage


def test_a_cancelled_job_is_rerun_alone(runs):
    workdir, output, jobs, cancelled_id = runs["cancelled"].result()
    assert f"SLURM-job '{cancelled_id}' failed, SLURM status is: 'CANCELLED'" in output
    assert output.count("Trying to restart job") == 1
    assert "Nothing to be done" in snakemake(workdir, "-n", *TARGETS).stdout  # every output whole and up to date


def test_artifacts_are_those_of_a_local_run(runs):
    workdir, *_ = runs["cancelled"].result()
    assert digests(workdir) == runs["local"].result()


def test_a_killed_snakemake_run_again_as_documented_submits_only_its_unfinished_job(runs):
    killed = runs["killed"].result()
    assert killed["at_kill"] == [("token_freq", "RUNNING"), ("tokenize", "COMPLETED")]
    returncode, output = killed["refused"]  # the killed run's lock is left behind
    assert returncode != 0 and "Directory cannot be locked" in output, output
    returncode, output = killed["unlocked"]
    assert returncode == 0, output
    returncode, output = killed["rerun"]
    assert returncode == 0, output
    assert [rule for _, rule in SUBMITTED.findall(output)] == ["token_freq"]


def test_a_killed_snakemake_loses_nothing_finished_and_leaves_nothing_half_written(runs):
    killed = runs["killed"].result()
    workdir = killed["workdir"]
    assert killed["tokenized_after"] == killed["tokenized"]  # tokenize's outputs: same bytes, same mtimes
    assert digests(workdir) == runs["local"].result()
    assert not list((workdir / "results").rglob("*.tmp"))  # no temporary of the cancelled job's
    assert "Nothing to be done" in snakemake(workdir, "-n", *TARGETS).stdout


def test_a_job_over_its_memory_is_killed_and_its_slurm_log_says_why(runs):
    workdir, returncode, output = runs["memory"].result()
    (job,) = [job for job, _ in SUBMITTED.findall(output)]
    log = workdir / f".snakemake/slurm_logs/rule_tokenize/{job}.log"
    assert returncode != 0
    # memory enforced by polling, not cgroups: the state is FAILED, the reason in the job's log
    assert f"SLURM-job '{job}' failed, SLURM status is: 'FAILED'" in output and str(log) in output, output
    limit = TOKENIZE_MEM_MB * 2**20  # bytes
    assert re.search(rf"StepId={job}\.batch exceeded memory limit \(\d+ > {limit}\), being killed", log.read_text())


def test_a_job_over_its_runtime_is_killed_and_its_slurm_log_says_why(runs):
    workdir, returncode, output, job = runs["timeout"].result()
    log = workdir / f".snakemake/slurm_logs/rule_tokenize/{job}.log"
    assert returncode != 0
    assert f"SLURM-job '{job}' failed, SLURM status is: 'TIMEOUT'" in output and str(log) in output, output
    assert re.search(rf"\*\*\* JOB {job} ON \S+ CANCELLED AT \S+ DUE TO TIME LIMIT \*\*\*", log.read_text())


# Multi-node training and the extraction shards grouped into one allocation (docs/CLUSTERS.md), each on
# a few of the demo's responses: what is checked is where the jobs ran, and that the artifacts are
# those of a local run, which runs beside the cluster's from a copy of the same workflow.
SAMPLES = 48  # the demo's first responses: 43 samples after tokenize, 5 optimizer steps of one epoch
MANIFEST, D2T, T2D, DRAFTER = (f"results/{path}" for path in ("hidden_states/manifest.json", "vocab/d2t.pt",
                                                                "vocab/t2d.pt", "drafter"))
MULTI_NODE = {"nodes": 2, "tasks": 2, "tasks_per_gpu": 0, "mpi": "srun"}  # docs/CLUSTERS.md's lines for train_drafter


def tiny_workflow(folder, target, update):
    """small_workflow on the demo's first SAMPLES responses, with `update` in its config."""
    folder.mkdir()
    workdir = small_workflow(folder, target)
    raw = folder / "raw_responses.jsonl"
    raw.write_text("".join(DEMO_RAW.read_text().splitlines(keepends=True)[:SAMPLES]))
    edit_config(workdir, merge({"data": {"raw_responses": str(raw)}}, update))
    return workdir


def fitted_profile(folder, rule, resources):
    """local_profile with `resources` set for `rule`."""
    path = local_profile(folder) / "config.yaml"
    profile = yaml.safe_load(path.read_text())
    profile["set-resources"][rule] |= resources
    path.write_text(yaml.safe_dump(profile))
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
    """train_drafter with train.num_processes 2 on CPU through sbatch, with docs/CLUSTERS.md's multi-node
    lines, the profile's gpu_model and cpus_per_gpu kept (training on CPU is a rule of 0 GPUs, which
    the Snakefile asks no GPU model for), from the shards of a local run. -> (its workdir, the local run's, the SLURM job's id, scontrol's record of it)"""
    workdir = tiny_workflow(tmp_path_factory.mktemp("multi_node") / "slurm", demo_target,
                            {"hidden_states": {"num_shards": 2},
                             "train": {"device": "cpu", "num_processes": 2, "epochs": 1}})
    snakemake(workdir, MANIFEST, D2T, T2D)  # everything training reads
    profile = fitted_profile(workdir.parent / "profile", "train_drafter", MULTI_NODE)
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
    assert "TresPerJob" not in record  # train.device cpu: no --gpus=<model>:0, though the profile names a model
    assert [field(record, name) for name in ("NodeList", "NumNodes", "NumTasks", "CPUs/Task", "BatchHost")] == [
        "n[1-2]", "2", "2", str(node_share()["CPUs"]), "n1"]
    assert step_tasks(slurm, f"{job_id}.0") == {"n1": ["0"], "n2": ["1"]}  # the job's first step: srun's torchruns
    log = (workdir / "results/logs/train_drafter.log").read_text()
    assert (f"launching 1 processes on each of 2 nodes: srun {CLUSTER_PYTHON} -m torch.distributed.run --nnodes=2 "
            f"--rdzv-backend=c10d --rdzv-endpoint={socket.gethostname()}:29500 --rdzv-id={job_id} "
            "--nproc-per-node=1 ") in log
    assert "device cpu, 2 processes" in log


def test_multi_node_training_trains_what_one_node_does(multi_node):
    """docs/CLUSTERS.md: the number of nodes is not part of what training computes. 2 processes on 2
    nodes train, tensor for tensor, the drafter of 2 on one node with the threads of both."""
    workdir, local, *_ = multi_node
    trained, expected = tensors(workdir / DRAFTER), tensors(local / DRAFTER)
    assert trained.keys() == expected.keys()
    assert all(torch.equal(trained[name], expected[name]) for name in expected)
    assert (workdir / DRAFTER / "config.json").read_text() == (local / DRAFTER / "config.json").read_text()


def tensors(drafter):
    with safe_open(drafter / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}




# A GPU phase across nodes (docs/CLUSTERS.md "A GPU phase across nodes"): the vLLM backend's 4 shards
# (the rule asks a GPU: hidden_states.device cuda; vLLM here is its CPU build) by `make slurm-phase`'s
# command in 2 allocations of a whole node each: shards 0 and 2 in the first, 1 and 3 in the second.
PHASE_SHARDS = [f"results/hidden_states/shard_{i:05d}.safetensors" for i in range(4)]
ALLOCATIONS = ["eaglenest-hidden_states-1of2", "eaglenest-hidden_states-2of2"]
SUBMITTED_ALLOCATION = re.compile(r"^(eaglenest-\w+-\dof2): job (\d+), (\d+) of its (\d+) outputs", re.M)


def slurm_phase(slurm, workdir, rule="hidden_states"):
    """The command of `make slurm-phase PHASE=<rule> NODES=2`, each allocation a node's memory (so
    one per node) and one GPU (bench/slurm_generate.py runs it for generate_part)."""
    sbatch = ["--partition=gpu", f"--gpus={GPU_MODEL}:1", f"--mem={node_share()['RealMemory']}"]
    return subprocess.Popen([sys.executable, "-m", "eaglenest.workflow.slurm_phase", rule, "--nodes", "2",
                             "--", *sbatch], cwd=workdir, env=slurm.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def one_done_one_started(workdir, outputs=PHASE_SHARDS, allocation=ALLOCATIONS[1]):
    """(the output of the second allocation's share that is written, the one whose job has started
    since), or None. `outputs`: the phase's, sorted, each named <wildcard>_<value>.<suffix>. Its jobs
    run one after another (one GPU, and each shard job asks one; a generate_part job asks a thread of
    the node's one); its log (.snakemake/slurm_phase/) names a job's wildcard when Snakemake starts
    it, seconds before the job's script can write anything."""
    share = outputs[1::2]
    log = "".join(path.read_text() for path in (workdir / ".snakemake/slurm_phase").glob(f"{allocation}-*.log"))
    done = [output for output in share if (workdir / output).exists()]
    started = [output for output in share
               if f"wildcards: {Path(output).name.split('.')[0].replace('_', '=')}" in log and output not in done]
    return (done[0], started[0]) if len(done) == 1 and started else None


def loads(workdir, job, logs="hidden_states"):
    """How often allocation `job`'s engine service loaded the target (its own log, in results/logs/<logs>/)."""
    return (workdir / f"results/logs/{logs}/engine-slurm{job}.log").read_text().count("target loaded in")


@pytest.fixture(scope="module")
def phase(slurm, demo_target, tmp_path_factory):
    """The phase across 2 allocations, with both faults: the second allocation cancelled (scancel) once
    one of its shards is written and the other's job started; the command rerun, and SIGKILLed once it
    has submitted the missing share; then run again. A local run of the same shards beside it.
    -> what each step left, by name"""
    workdir = tiny_workflow(tmp_path_factory.mktemp("phase") / "slurm", demo_target,
                            {"hidden_states": {"backend": "vllm", "device": "cuda", "num_shards": len(PHASE_SHARDS)},
                             # speed only: a KV cache of 0.5 GB, made in 0.3 s, not the default's 4 GB in 8 s
                             "vllm": {"gpu_memory_utilization": 0.05}})
    # An ordinary GPU job of the profile: its partition, gpu_model and runtime as shipped, memory fitted
    profile = fitted_profile(workdir.parent / "profile", "engine_start_check", {"mem_mb": node_share()["RealMemory"]})
    returncode, output = finished(on_cluster(slurm, workdir, profile, "results/engine_start_check.json"))
    assert returncode == 0, output
    [(check_job, _)] = SUBMITTED.findall(output)
    check = slurm.run("scontrol", "show", "job", check_job)
    snakemake(workdir, "results/data/shards")  # what the phase reads, made before it (the command checks)
    local = workdir.parent / "local"
    shutil.copytree(workdir, local, symlinks=True)
    with open(workdir.parent / "local.log", "w") as out, subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "2", *PHASE_SHARDS], cwd=local, stdout=out,
            stderr=subprocess.STDOUT) as twin:
        first = slurm_phase(slurm, workdir)
        wait_until(lambda: one_done_one_started(workdir) or first.poll() is not None,
                   "a shard of the second allocation written and the next one started", timeout_s=300)
        assert first.poll() is None, first.communicate()[0]
        done, in_flight = one_done_one_started(workdir)
        # each allocation's job from its log's name (the first may have finished already: scontrol still shows it)
        jobs = dict(re.fullmatch(r"(.+)-(\d+)\.log", path.name).groups()
                    for path in (workdir / ".snakemake/slurm_phase").glob("*.log"))
        done_before = stamps(workdir, [done])
        slurm.run("scancel", jobs[ALLOCATIONS[1]])
        running = {name: slurm.run("scontrol", "show", "job", job) for name, job in jobs.items()}
        first_run = finished(first)
        finished_shards = [shard for shard in PHASE_SHARDS if shard != in_flight]
        after_cancel = {"finished": stamps(workdir, finished_shards), "in flight": (workdir / in_flight).exists(),
                        "done before": done_before}
        rerun = slurm_phase(slurm, workdir)
        submitted = next(line for line in rerun.stdout if SUBMITTED_ALLOCATION.match(line))
        rerun.kill()  # the command killed: its allocation runs on
        finished(rerun)
        again = finished(slurm_phase(slurm, workdir))
    assert twin.returncode == 0, (workdir.parent / "local.log").read_text()
    return {"workdir": workdir, "local": local, "jobs": jobs, "running": running, "first": first_run,
            "after_cancel": after_cancel, "submitted": submitted, "again": again,
            "after": stamps(workdir, finished_shards), "done": done, "in flight": in_flight, "check": check}


def test_an_ordinary_gpu_job_of_the_profile_asks_its_gpu_model_as_shipped(phase):
    """engine_start_check (a GPU rule of one GPU) through the profile: one sbatch job whose
    `--gpus=<model>:1` scontrol shows, with the shipped profile's partition, gpu_model and runtime
    (local_profile fits only memory and CPUs to the node)."""
    shipped = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())["set-resources"]["engine_start_check"]
    record = phase["check"]
    assert field(record, "JobState") == "COMPLETED" and field(record, "Partition") == shipped["slurm_partition"]
    assert field(record, "TresPerJob") == f"gres:gpu:{shipped['gpu_model']}:1"
    assert field(record, "TimeLimit") == f"00:{shipped['runtime']:02d}:00"


def test_a_phase_across_two_allocations_runs_each_on_its_own_node_with_one_load(phase):
    """Each allocation runs on a node of its own, on partition gpu with its GPU, and its engine service
    loads the target once for its share."""
    workdir, running = phase["workdir"], phase["running"]
    assert {field(record, "NodeList") for record in running.values()} == set(NODES)  # one allocation per node
    for name, record in running.items():
        assert field(record, "Partition") == "gpu"  # read as the second is being cancelled
        assert field(record, "TresPerJob") == f"gres:gpu:{GPU_MODEL}:1" and field(record, "JobName") == name
        assert field(record, "StdOut") == str(workdir / f".snakemake/slurm_phase/{name}-{phase['jobs'][name]}.log")
    returncode, output = phase["first"]
    assert sorted(SUBMITTED_ALLOCATION.findall(output)) == [(ALLOCATIONS[0], phase["jobs"][ALLOCATIONS[0]], "2", "2"),
                                                             (ALLOCATIONS[1], phase["jobs"][ALLOCATIONS[1]], "2", "2")]
    assert [loads(workdir, phase["jobs"][name]) for name in ALLOCATIONS] == [1, 1]


def test_a_cancelled_allocation_loses_nothing_finished_and_leaves_nothing_half_written(phase):
    """The second allocation cancelled while a shard's job had started, its other shard written: the
    command reports the shard in flight missing; every shard written keeps its bytes and mtime
    through the reruns; the shard in flight was not there at all, and no temporary is left once the
    rerun made it."""
    returncode, output = phase["first"]
    assert returncode == 1 and "1 hidden_states outputs are still missing or stale" in output, output
    assert output.rstrip().endswith(phase["in flight"])
    assert not phase["after_cancel"]["in flight"]
    assert phase["after"] == phase["after_cancel"]["finished"]
    assert phase["after"][phase["done"]] == phase["after_cancel"]["done before"][phase["done"]]
    assert not list((phase["workdir"] / "results").rglob("*.tmp"))


def test_a_rerun_makes_only_the_missing_shard_with_one_load_and_a_killed_command_submits_nothing_twice(phase):
    """The rerun submits the second share alone, with one shard of it to make; killed, and run again,
    the command finds that allocation in squeue and waits for it instead of submitting it again.
    Three allocations in all, each one load."""
    workdir = phase["workdir"]
    name, job, todo, share = SUBMITTED_ALLOCATION.match(phase["submitted"]).groups()
    assert (name, todo, share) == (ALLOCATIONS[1], "1", "2")
    returncode, output = phase["again"]
    assert returncode == 0, output
    assert f"{ALLOCATIONS[1]}: job {job} runs or waits already, not submitted again" in output
    assert not SUBMITTED_ALLOCATION.search(output)
    assert len(list((workdir / ".snakemake/slurm_phase").glob("*.log"))) == 3 and loads(workdir, job) == 1


def test_a_phase_across_allocations_makes_a_local_runs_shards_and_the_rest_runs_as_today(phase):
    """Byte for byte the shards of one engine in a local run; what follows the phase is planned as
    after any run: the manifest alone."""
    workdir, local = phase["workdir"], phase["local"]
    assert all((workdir / shard).read_bytes() == (local / shard).read_bytes() for shard in PHASE_SHARDS)
    planned = snakemake(workdir, "-n", "results/hidden_states/manifest.json").stdout
    assert re.findall(r"^rule (\w+):", planned, re.M) == ["hidden_states_manifest"], planned


@pytest.mark.parametrize("rule", ["generate_part", "hidden_states"])
def test_a_phase_whose_inputs_are_not_made_is_refused_before_any_allocation(rule, tmp_path):
    """Each allocation would make them again (N writers of one file): the command names the rules to
    run first and submits nothing (no SLURM needed to refuse)."""
    workdir = new_workdir(tmp_path)
    run = subprocess.run([sys.executable, "-m", "eaglenest.workflow.slurm_phase", rule, "--nodes", "2"], cwd=workdir,
                         capture_output=True, text=True)
    assert run.returncode == 2 and re.fullmatch(
        rf"error: {rule} reads what (\w+, )*split_prompts(, \w+)* must make first: run them before the phase, e\.g\. "
        r"snakemake --profile profiles/slurm --until [\w ]+\n", run.stderr), run.stderr
    assert not (workdir / ".snakemake/slurm_phase").exists()
