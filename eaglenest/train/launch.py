"""Launching DDP training: torchrun on this node, or on each of several nodes (multi-node SLURM)."""

import ctypes
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch

from eaglenest import CHECKOUT
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)

PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None  # resolved before any fork
PR_SET_PDEATHSIG = 1
RDZV_PORT = 29500  # multi-node: torchrun's rendezvous on the node that launches the others
WORKER_MODULE = "eaglenest.train"  # what each torchrun process runs: eaglenest/train/__main__.py
# The thread counts Snakemake sets to a job's threads (snakemake/shell.py): each worker gets its
# share. MKL's count changes its float rounding: left at the job's, a run of 2 processes on one
# node of 2 threads (MKL on 2 each) and on 2 nodes of 1 (MKL on 1) trained different weights.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def die_with_parent():
    """Have the kernel SIGKILL this process when its parent dies (Linux): a killed job leaves
    no torchrun or DDP worker training on (torchrun starts its workers in sessions of their
    own, out of reach of a kill of the job's process group)."""
    if PRCTL is not None:
        PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def torchrun_command(arguments_path, num_processes, nnodes=1, launcher="", rdzv_endpoint=None, rdzv_id=None):
    """The command that starts num_processes training processes: one torchrun on this node
    (--standalone), or with nnodes > 1 one torchrun on each node with num_processes / nnodes
    processes, all started by `launcher` (e.g. "srun", which in a SLURM job of `nodes` nodes and
    as many tasks starts one on each node), meeting at `rdzv_endpoint` (host:port of this node,
    where torchrun's c10d store runs)."""
    if num_processes % nnodes:
        raise InputError(f"train.num_processes {num_processes} is not a multiple of the {nnodes} nodes")
    if nnodes > 1 and not launcher:
        raise InputError(f"{nnodes} nodes need a launcher that starts torchrun on each (resource mpi, e.g. srun)")
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        torchrun.append("--standalone")
    else:
        torchrun += [
            f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
        ]
    return [
        *shlex.split(launcher), *torchrun, f"--nproc-per-node={num_processes // nnodes}", "-m", WORKER_MODULE,
        str(arguments_path),
    ]


def launch_workers(arguments):
    """Run train_drafter in num_processes processes with torchrun, on this node or spread evenly
    over `nnodes` nodes (see torchrun_command), each running `python -m eaglenest.train ARGS`.
    The workers' output goes to this process's log."""
    # beside the log: on the file system the job writes to (a multi-node one shares it), and
    # replaced, not piled up, by a rerun after a kill
    log_path = Path(arguments["log_path"])
    path = log_path.with_name(f".{log_path.name}.torchrun.json")
    command = torchrun_command(
        path, arguments["num_processes"], arguments["nnodes"], arguments["launcher"],
        f"{socket.gethostname()}:{RDZV_PORT}", os.environ.get("SLURM_JOB_ID", os.getpid()),
    )
    n = arguments["num_processes"] // arguments["nnodes"]  # processes on this node
    share = str(max(1, torch.get_num_threads() // n))  # of this job's threads, a worker's
    env = dict(
        os.environ,
        **dict.fromkeys(THREAD_VARIABLES, share),
        # the workers import this very eaglenest: not one in the working directory (safe path),
        # nor an installed copy of another checkout
        PYTHONPATH=os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")])),
        PYTHONSAFEPATH="1",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(arguments, default=str))
    log.info("launching %d processes on each of %d nodes: %s", n, arguments["nnodes"], shlex.join(command))
    try:
        with subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=die_with_parent,
        ) as workers:
            for line in workers.stdout:
                log.info("%s", line.rstrip())
    finally:
        path.unlink()
    if workers.returncode:
        raise RuntimeError(f"torchrun exited with status {workers.returncode} (output above)")
