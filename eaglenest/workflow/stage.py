"""Running one pipeline stage: logging to the rule's log file, a lease on its GPUs, clean
one-line errors for bad input."""

import atexit
import logging
import os
import sys
import threading

from eaglenest.workflow.errors import InputError
from eaglenest.workflow.gpu_lease import gpu_lease


def run_stage(log_path, threads, fn, *args, gpus=0, **kwargs):
    """A rule's job, as its script runs it: call_stage, then the process ends (end_process)."""
    call_stage(log_path, threads, fn, *args, gpus=gpus, **kwargs)
    end_process()


def call_stage(log_path, threads, fn, *args, gpus=0, **kwargs):
    """fn(*args, **kwargs), with logging to `log_path` and stderr, on `threads` torch threads,
    holding a lease on `gpus` devices (the rule's `gpu` resource; see eaglenest.workflow.gpu_lease).

    The rule's log is where Snakemake points a user, so it holds the failure: an InputError as
    its one-line message (no traceback), any other error with its traceback. Either ends the
    process; outputs are written atomically by the stages, so nothing partial is left behind.
    """
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(log_path, mode="w"), logging.StreamHandler(sys.stderr)],
        force=True,
    )
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(max(1, threads))
    else:  # read when the stage imports torch; a stage that never does (prompts, JSON) is spared its import
        os.environ["OMP_NUM_THREADS"] = str(max(1, threads))
    try:
        with gpu_lease(gpus):  # sets CUDA_VISIBLE_DEVICES: CUDA starts inside fn, not before
            return fn(*args, **kwargs)
    except InputError as e:
        logging.getLogger(fn.__module__).error("%s", e)
        sys.exit(f"error: {e}")
    except Exception as e:
        logging.getLogger(fn.__module__).exception("%s failed", fn.__name__)
        sys.exit(f"error: {type(e).__name__}: {e} (traceback in {log_path})")


def end_process():
    """End this process as a normal exit would, less the interpreter's teardown of its modules.

    Everything a process writes is written and closed by then (outputs are renamed into place),
    but tearing down torch, transformers and vLLM object by object costs 0.4 (torch alone) to 2.5
    (vLLM) CPU-seconds per process (BENCHMARKS.md, "The suite"), hundreds of processes in a run.
    What a normal exit does first still happens here: other non-daemon threads are joined, the
    atexit handlers run (an engine's processes stop, multiprocessing's children are joined,
    trackers finish, logs are flushed), and so are the standard streams."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
