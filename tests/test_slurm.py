"""profiles/slurm on a real one-node SLURM cluster (tests/slurm_cluster.py: slurmctld, slurmd and
munge on this machine): jobs go through sbatch, a job cancelled while it runs is rerun alone, and
the artifacts are byte-identical to a local run's. The CPU stages from the responses to the token
counts: the GPU stages start vLLM, minutes a job here (docs/GPUS.md says what was checked by hand)."""

import hashlib
import re
import shutil
import subprocess
import time

import pytest
import yaml

from conftest import DEMO_RAW, REPO, new_workdir, snakemake
from slurm_cluster import LocalSlurm, alive, machine
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
    """profiles/slurm fitted to the one-node cluster, as docs/GPUS.md tells a small cluster's user:
    its partitions and GPU model as they are; memory, CPUs and threads within this node; job
    states from squeue (no accounting daemon); status checks every second (the plugin's default
    40 s is for a busy scheduler); SLURM logs kept for the checks below."""
    settings = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    node = machine()
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
