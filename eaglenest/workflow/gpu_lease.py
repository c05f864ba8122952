"""GPU leases: which devices a job may use, when several GPU jobs share one machine.

Snakemake caps how many GPUs its running jobs hold (`--resources gpu=8`) but does not say which:
without a lease every job would start on device 0. A job needing N GPUs takes an exclusive
flock on N per-device lock files, then sets CUDA_VISIBLE_DEVICES to those devices before CUDA
starts (torch and vLLM read it at their first CUDA call, and their workers inherit it). The
kernel drops a flock when its holder dies, however it dies, so a killed job frees its devices.

Settings, from the environment (the machine's facts, not the workflow's):
- EAGLENEST_GPU_IDS: the devices to lease, e.g. "0,1,2,3,4,5,6,7". Unset: those in
  CUDA_VISIBLE_DEVICES, else those `nvidia-smi -L` lists (a GPU by its index; a GPU split by MIG
  as its MIG devices, by UUID: CUDA runs on those, not on their GPU), else none (no lease: CPU
  machine).
  Under SLURM or Kubernetes the scheduler already gave the job its own devices: no lease there
  unless EAGLENEST_GPU_IDS asks for one.
- EAGLENEST_GPU_LOCK_DIR: where the lock files live; default /tmp/eaglenest-gpu-locks, shared by
  every run on the machine, so that two workflows on one box do not share devices either.

No torch here: importing it must not come before CUDA_VISIBLE_DEVICES is set.
"""

import contextlib
import fcntl
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_LOCK_DIR = "/tmp/eaglenest-gpu-locks"
GPU_LINE = re.compile(r"GPU (\d+): ")  # GPU 0: NVIDIA RTX PRO 6000 Blackwell Server Edition (UUID: GPU-...)
MIG_LINE = re.compile(r"MIG .*\(UUID: (MIG-[^)\s]+)\)")  # under it, indented: MIG 1g.24gb  Device  0: (UUID: MIG-...)
SCHEDULER_VARIABLES = ("SLURM_JOB_ID", "KUBERNETES_SERVICE_HOST")  # they assign devices themselves


def gpu_ids(environ=os.environ):
    """The device ids this machine leases out (see the module docstring), as strings."""
    if environ.get("EAGLENEST_GPU_IDS") is not None:
        return split_ids(environ["EAGLENEST_GPU_IDS"])
    if any(name in environ for name in SCHEDULER_VARIABLES):
        return []
    if environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return split_ids(environ["CUDA_VISIBLE_DEVICES"])
    if (nvidia_smi := shutil.which("nvidia-smi", path=environ.get("PATH"))) is None:
        return []
    listing = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True)
    return listed_devices(listing.stdout) if listing.returncode == 0 else []


def listed_devices(listing):
    """The devices of an `nvidia-smi -L` listing as CUDA_VISIBLE_DEVICES names them: each GPU's
    index, or, for a GPU with MIG devices listed under it, their UUIDs (MIG-...), each one a device
    of its own (tests/nvidia_smi/ holds real listings)."""
    gpus = []  # [index, [MIG UUIDs]] in the listing's order
    for line in map(str.strip, listing.splitlines()):
        if gpu := GPU_LINE.match(line):
            gpus.append((gpu[1], []))
        elif (mig := MIG_LINE.match(line)) and gpus:
            gpus[-1][1].append(mig[1])
    return [device for index, migs in gpus for device in migs or [index]]


def split_ids(text):
    """'0, 1,2' -> ['0', '1', '2']."""
    return [i.strip() for i in text.split(",") if i.strip()]


def try_lock(lock_dir, ids, count):
    """Exclusive flocks on `count` of `ids` (open files), or None and nothing held."""
    held = []
    for i in ids:
        lock = open(Path(lock_dir) / f"gpu{i.replace('/', '_')}.lock", "a")  # drivers before R470: MIG-GPU-.../1/0
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        held.append((i, lock))
        if len(held) == count:
            return held
    for _, lock in held:  # all or nothing: a job holding some while waiting could deadlock another
        lock.close()
    return None


@contextlib.contextmanager
def gpu_lease(count, *, environ=os.environ, poll_s=1.0, timeout_s=None):
    """Hold `count` devices while inside; sets CUDA_VISIBLE_DEVICES in `environ` to them.

    Waits, saying so in the log, while fewer than `count` are free; raises TimeoutError after
    `timeout_s` seconds if given. count 0, or no devices to lease (see gpu_ids): no lease.
    Yields the leased ids (empty without a lease).
    """
    ids = gpu_ids(environ) if count > 0 else []
    if not ids:
        if count > 0:
            log.info("no GPU ids to lease (EAGLENEST_GPU_IDS, CUDA_VISIBLE_DEVICES, nvidia-smi): no lease")
        yield []
        return
    if count > len(ids):
        raise ValueError(f"a job needs {count} GPUs but this machine leases out {len(ids)}: {','.join(ids)}")
    lock_dir = Path(environ.get("EAGLENEST_GPU_LOCK_DIR") or DEFAULT_LOCK_DIR)
    lock_dir.mkdir(parents=True, exist_ok=True)
    start, waiting = time.monotonic(), False
    while (held := try_lock(lock_dir, ids, count)) is None:
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"no {count} free GPUs of {','.join(ids)} in {timeout_s} s ({lock_dir})")
        if not waiting:
            log.info("waiting for %d free GPUs of %s (locks in %s)", count, ",".join(ids), lock_dir)
            waiting = True
        time.sleep(poll_s)
    leased = [i for i, _ in held]
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(leased)
    log.info("leased GPUs %s (CUDA_VISIBLE_DEVICES) after %.1f s", ",".join(leased), time.monotonic() - start)
    try:
        yield leased
    finally:
        for _, lock in held:
            lock.close()
