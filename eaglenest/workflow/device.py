"""Which torch device a stage computes on."""

import os


def torch_device(device=None):
    """`device` (a torch device name), by default cuda when available, else cpu; under torchrun
    the cuda device of this process's LOCAL_RANK."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device
