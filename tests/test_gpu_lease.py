"""GPU leases over fake devices: real concurrent Snakemake jobs, real processes killed with SIGKILL."""

import json
import logging
import os
import subprocess
import sys

import pytest

from conftest import REPO
from eaglenest.workflow.gpu_lease import gpu_ids, gpu_lease, listed_devices
from eaglenest.workflow.stage import call_stage

IDS = "0,1,2,3,4,5,6,7"
JOBS = {"g1_a": 1, "g1_b": 1, "g1_c": 1, "g1_d": 1, "g2_a": 2, "g2_b": 2, "g2_c": 2, "g4_a": 4, "g4_b": 4,
        "kill_4": 4, "full_8": 8}  # name: GPUs

# One job: lease its GPUs, record what it got and when (the lease records the test reads back:
# "start" once the lease is held, "end" before it is let go, on the machine's monotonic clock, one
# for every process), hold them a moment. The job named kill_* dies by SIGKILL while holding its
# lease (no Python cleanup runs: only the kernel frees it).
JOB = """
import json, os, signal, sys, time
from pathlib import Path
from eaglenest.workflow.gpu_lease import gpu_lease

name, gpus, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
with gpu_lease(gpus, poll_s=0.05, timeout_s=300) as ids:  # a hang guard: under gpu=8 no lease waits
    record = {"name": name, "ids": ids, "cuda": os.environ["CUDA_VISIBLE_DEVICES"], "start": time.monotonic()}
    if name.startswith("kill"):
        record["end"] = time.monotonic()
        Path("records", name + ".json").write_text(json.dumps(record))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    record["end"] = time.monotonic()
    Path("records", name + ".json").write_text(json.dumps(record))
out.touch()
"""

SNAKEFILE = """
rule all:
    input: expand("done/{name}", name=JOBS)

rule job:
    output: "done/{name}"
    log: "logs/{name}.log"
    resources: gpu=lambda wildcards: JOBS[wildcards.name]
    priority: lambda wildcards: 10 if wildcards.name.startswith("kill") else 0
    shell: "{PYTHON} job.py {wildcards.name} {resources.gpu} {output} 2> {log}"
"""


def fake_devices(tmp_path):
    """Environment for a lease over 8 fake devices, with private lock files."""
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "KUBERNETES_SERVICE_HOST")}
    return env | {"EAGLENEST_GPU_IDS": IDS, "EAGLENEST_GPU_LOCK_DIR": str(tmp_path / "locks"), "PYTHONPATH": str(REPO)}


def test_concurrent_snakemake_jobs_never_share_a_device_and_a_killed_job_frees_its_own(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "Snakefile").write_text(f"PYTHON = {sys.executable!r}\nJOBS = {JOBS!r}\n" + SNAKEFILE)
    (tmp_path / "records").mkdir()
    result = subprocess.run(  # the timeout only stops a hung run from hanging the suite
        [sys.executable, "-m", "snakemake", "--cores", "8", "--resources", "gpu=8", "--keep-going"],
        cwd=tmp_path, env=fake_devices(tmp_path), capture_output=True, text=True, timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Error in rule job" in output  # the killed one, only
    assert {p.name for p in (tmp_path / "done").iterdir()} == JOBS.keys() - {"kill_4"}, output
    # every job got a lease of its own size, on distinct devices of the 8, and ran on them; full_8
    # among them, which needs the 4 that kill_4 held when it died: only the kernel freed them
    records = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "records").iterdir()}
    assert records.keys() == JOBS.keys()
    for name, record in records.items():
        assert len(set(record["ids"])) == len(record["ids"]) == JOBS[name], record
        assert set(record["ids"]) <= set(IDS.split(",")) and record["cuda"] == ",".join(record["ids"]), record
    # leases never overlap on one device: on each, one holder ends before the next one starts
    holders = {}
    for record in records.values():
        for device in record["ids"]:
            holders.setdefault(device, []).append(record)
    assert holders.keys() == set(IDS.split(","))  # full_8 held every one
    for device, held in holders.items():
        held.sort(key=lambda record: record["start"])
        for before, after in zip(held, held[1:]):
            assert before["end"] < after["start"], (device, before, after)


def test_a_lease_waits_while_the_devices_are_held_and_a_killed_holder_frees_them(tmp_path, monkeypatch, caplog):
    env = fake_devices(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from eaglenest.workflow.gpu_lease import gpu_lease\n"
                               "with gpu_lease(6) as ids:\n    print(','.join(ids), flush=True); time.sleep(60)"],
        env=env, stdout=subprocess.PIPE, text=True,
    )
    try:
        held = holder.stdout.readline().strip().split(",")
        assert held == ["0", "1", "2", "3", "4", "5"]
        environ = {"EAGLENEST_GPU_IDS": IDS, "EAGLENEST_GPU_LOCK_DIR": env["EAGLENEST_GPU_LOCK_DIR"]}
        with gpu_lease(2, environ=environ, timeout_s=5) as ids:  # the two the holder left
            assert ids == ["6", "7"] and environ["CUDA_VISIBLE_DEVICES"] == "6,7"
        caplog.set_level(logging.INFO, logger="eaglenest.workflow.gpu_lease")
        with pytest.raises(TimeoutError):
            with gpu_lease(3, environ=environ, poll_s=0.05, timeout_s=0.3):
                pass
        assert "waiting for 3 free GPUs of 0,1,2,3,4,5,6,7" in caplog.text
    finally:
        holder.kill()  # SIGKILL
        holder.wait()
    with gpu_lease(8, environ=environ, timeout_s=5) as ids:
        assert ids == IDS.split(",")


def test_device_ids_come_from_the_environment(tmp_path):
    assert gpu_ids({"EAGLENEST_GPU_IDS": "4, 5,6", "SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0"}) == ["4", "5", "6"]
    assert gpu_ids({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,1"}) == []  # SLURM gave the job its GPUs
    assert gpu_ids({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "CUDA_VISIBLE_DEVICES": "0"}) == []
    assert gpu_ids({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert gpu_ids({"PATH": str(tmp_path)}) == []  # no nvidia-smi: a CPU machine
    environ = {"EAGLENEST_GPU_IDS": "0,1", "EAGLENEST_GPU_LOCK_DIR": str(tmp_path)}
    with gpu_lease(0, environ=environ) as ids:  # a CPU stage: no lease, devices untouched
        assert ids == [] and "CUDA_VISIBLE_DEVICES" not in environ
    with pytest.raises(ValueError, match="needs 4 GPUs but this machine leases out 2: 0,1"):
        with gpu_lease(4, environ=environ):
            pass


LISTINGS = REPO / "tests" / "nvidia_smi"  # real `nvidia-smi -L` output; its README says from where


def mig_uuids(listing):
    """The MIG UUIDs of a listing file, in order, read without the parser."""
    return [line.split("(UUID: ")[1].rstrip(")") for line in (LISTINGS / listing).read_text().splitlines()
            if line.startswith("  MIG ")]


def test_nvidia_smi_listings_of_real_machines_give_one_device_per_gpu_or_per_mig_device():
    """A whole GPU is leased by its index; a GPU split by MIG as each of its MIG devices, by UUID,
    as CUDA_VISIBLE_DEVICES takes them (CUDA runs on MIG devices, not on the GPU they split)."""
    read = lambda name: listed_devices((LISTINGS / name).read_text())  # noqa: E731
    assert read("rtx_pro_6000_x8.txt") == ["0", "1", "2", "3", "4", "5", "6", "7"]
    blackwell_mig = read("rtx_pro_6000_x8_mig.txt")  # 8 cards, four 1g.24gb devices each
    assert blackwell_mig == mig_uuids("rtx_pro_6000_x8_mig.txt") and len(set(blackwell_mig)) == 32
    assert blackwell_mig[:2] == ["MIG-445da789-865d-5fd1-b2b6-32a48bf66c39", "MIG-e78fd5d2-f2de-5632-8961-9a368cec8080"]
    assert read("a100_x4_mig_on_gpu0.txt") == mig_uuids("a100_x4_mig_on_gpu0.txt") + ["1", "2", "3"]
    assert read("a100_mig_x7.txt") == mig_uuids("a100_mig_x7.txt") and len(read("a100_mig_x7.txt")) == 7


def nvidia_smi(folder, listing, returncode=0):
    """An `nvidia-smi` executable in `folder` that prints `listing` (a file of LISTINGS) and exits."""
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat '{LISTINGS / listing}'\nexit {returncode}\n")
    script.chmod(0o755)


def test_without_settings_a_lease_takes_the_devices_nvidia_smi_lists(tmp_path):
    """gpu_ids runs `nvidia-smi -L` from the job's PATH: on a machine whose GPU 0 is split by MIG,
    a job of two leases two of its MIG devices, the next job of three the other two and GPU 1; a
    failing nvidia-smi (no driver) means no GPUs."""
    nvidia_smi(tmp_path, "a100_x4_mig_on_gpu0.txt")
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"  # ahead of a real one

    def job():
        return {"PATH": path, "EAGLENEST_GPU_LOCK_DIR": str(tmp_path / "locks")}

    migs = mig_uuids("a100_x4_mig_on_gpu0.txt")
    assert gpu_ids(job()) == [*migs, "1", "2", "3"]
    environ = job()
    with gpu_lease(2, environ=environ) as ids:
        assert ids == migs[:2] and environ["CUDA_VISIBLE_DEVICES"] == f"{migs[0]},{migs[1]}"
        with gpu_lease(3, environ=job()) as more:
            assert more == [*migs[2:], "1"]
    nvidia_smi(tmp_path, "rtx_pro_6000_x8.txt", returncode=9)
    assert gpu_ids(job()) == []


def test_a_stage_runs_on_its_leased_devices(tmp_path, monkeypatch):
    for name, value in fake_devices(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = call_stage(tmp_path / "stage.log", 1, lambda: os.environ["CUDA_VISIBLE_DEVICES"], gpus=2)
    assert seen == "0,1"
    assert "leased GPUs 0,1" in (tmp_path / "stage.log").read_text()
    logging.getLogger().handlers.clear()  # call_stage's log file handler: not into later tests
