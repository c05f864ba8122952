"""Resuming a killed training run: the loop state in periodic checkpoints, valid only for the run
(settings, data, vocab, target, code) that wrote them."""

import hashlib
import json
import logging
from pathlib import Path

import torch

from eaglenest import CHECKOUT
from eaglenest.data.target import target_config
from eaglenest.data.vocab import load_vocab
from eaglenest.workflow.atomic import save_torch
from eaglenest.workflow.fingerprint import code_fingerprint

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"  # in resume_dir


# Arguments that leave what training computes unchanged: a checkpoint stays valid across them.
NOT_IN_RUN_KEY = (
    "out_dir", "log_path", "trained_config_path", "resume_dir", "checkpoint_every", "num_processes", "num_workers",
    "device", "verifier_name_or_path", "export_dtype", "nnodes", "launcher", "tracking",
)


def run_key(arguments):
    """Hash of everything that determines a training run: its settings, the data (the manifest
    holds each shard's sha256), the vocab maps, the target's config, the init_from path and the
    training code. A checkpoint with another key belongs to another run."""
    key = {name: value for name, value in arguments.items() if name not in NOT_IN_RUN_KEY}
    key["shard_paths"] = [Path(path).name for path in arguments["shard_paths"]]
    key["manifest_path"] = Path(arguments["manifest_path"]).read_text()
    # by content, not by file bytes: what identifies the vocabulary is its ids, however it was serialised
    d2t, t2d = load_vocab(key.pop("d2t_path"), key.pop("t2d_path"))
    key["vocab"] = hashlib.sha256(d2t.numpy().tobytes() + t2d.numpy().tobytes()).hexdigest()
    key["target_dir"] = target_config(arguments["target_dir"])
    key["code"] = code_fingerprint(CHECKOUT, "eaglenest/train/loop.py")
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def read_resume_checkpoint(resume_dir, key):
    """The checkpoint in resume_dir if it was written by the run with this key, else None."""
    path = Path(resume_dir) / CHECKPOINT
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["run_key"] != key:
        log.info("ignoring the stale checkpoint %s (of other settings, data or code)", path)
        return None
    return state


def save_loop_state(path, drafter, optimizer, device, **progress):
    """Checkpoint the loop state: weights (but the frozen embed_tokens, the target's), the
    optimizers with their schedulers (eaglenest.train.optim.Optimizers), RNG, and `progress` (run_key, step, tokens, elapsed, log rows, window)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    weights = {n: t for n, t in drafter.state_dict().items() if n != "embed_tokens.weight"}
    save_torch(path, {
        "drafter": weights, "optimizer": optimizer.state_dict(), "rng": rng, **progress,
    })


def restore_loop_state(state, drafter, optimizer, device):
    """Load a save_loop_state checkpoint into the loop's objects and the RNG."""
    drafter.load_state_dict(state["drafter"], strict=False)  # all but embed_tokens
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["cpu"])
    if device.type == "cuda" and "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)
