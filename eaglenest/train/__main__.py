"""torchrun's entry, `python -m eaglenest.train ARGS.json`: one DDP process of train_drafter
(started by eaglenest.train.launch)."""

import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from eaglenest.train.launch import die_with_parent
from eaglenest.train.loop import train_drafter
from eaglenest.workflow.device import torch_device
from eaglenest.workflow.stage import end_process


def main(arguments_path):
    """torchrun's entry: this process's rank of train_drafter, arguments from a JSON file."""
    die_with_parent()
    arguments = json.loads(Path(arguments_path).read_text())
    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"rank {rank} %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    device = torch_device(arguments.pop("device"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        train_drafter(**arguments, device=str(device))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    end_process()
