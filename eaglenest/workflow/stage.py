"""Running one pipeline stage: logging to the rule's log file, a lease on its GPUs, clean
one-line errors for bad input."""

import logging
import sys

from eaglenest.workflow.errors import InputError
from eaglenest.workflow.gpu_lease import gpu_lease


def run_stage(log_path, threads, fn, *args, gpus=0, **kwargs):
    """Call fn(*args, **kwargs) with logging to `log_path` and stderr, on `threads` torch threads,
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
    import torch

    torch.set_num_threads(max(1, threads))
    try:
        with gpu_lease(gpus):  # sets CUDA_VISIBLE_DEVICES: CUDA starts inside fn, not before
            return fn(*args, **kwargs)
    except InputError as e:
        logging.getLogger(fn.__module__).error("%s", e)
        sys.exit(f"error: {e}")
    except Exception as e:
        logging.getLogger(fn.__module__).exception("%s failed", fn.__name__)
        sys.exit(f"error: {type(e).__name__}: {e} (traceback in {log_path})")
