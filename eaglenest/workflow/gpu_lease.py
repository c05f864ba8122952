"""GPU leases: which devices a job may use, when several GPU jobs share one machine.

Snakemake caps how many GPUs its running jobs hold (`--resources gpu=8`) but does not say which:
without a lease every job would start on device 0. A job needing N GPUs takes an exclusive
flock on N per-device lock files, then sets CUDA_VISIBLE_DEVICES to those devices before CUDA
starts (torch and vLLM read it at their first CUDA call, and their workers inherit it). The
kernel drops a flock when its holder dies, however it dies, so a killed job frees its devices.

Settings, from the environment (the machine's facts, not the workflow's):
- EAGLENEST_GPU_IDS: the devices to lease, e.g. "0,1,2,3,4,5,6,7". Unset: those in
  CUDA_VISIBLE_DEVICES, else those `nvidia-smi -L` lists, else none (no lease: CPU machine).
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
import shutil
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_LOCK_DIR = "/tmp/eaglenest-gpu-locks"
SCHEDULER_VARIABLES = ("SLURM_JOB_ID", "KUBERNETES_SERVICE_HOST")  # they assign devices themselves


def gpu_ids(environ=os.environ):
    """The device ids this machine leases out (see the module docstring), as strings."""
    if environ.get("EAGLENEST_GPU_IDS") is not None:
        return split_ids(environ["EAGLENEST_GPU_IDS"])
    if any(name in environ for name in SCHEDULER_VARIABLES):
        return []
    if environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return split_ids(environ["CUDA_VISIBLE_DEVICES"])
    if shutil.which("nvidia-smi") is None:
        return []
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    count = sum(line.startswith("GPU ") for line in listing.stdout.splitlines())
    return [str(i) for i in range(count)] if listing.returncode == 0 else []


def split_ids(text):
    """'0, 1,2' -> ['0', '1', '2']."""
    return [i.strip() for i in text.split(",") if i.strip()]


def try_lock(lock_dir, ids, count):
    """Exclusive flocks on `count` of `ids` (open files), or None and nothing held."""
    held = []
    for i in ids:
        lock = open(Path(lock_dir) / f"gpu{i}.lock", "a")
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
