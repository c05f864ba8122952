"""Atomic file and directory writes: a killed job never leaves a half-written artifact."""

import contextlib
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _remove_leftovers(path):
    """Remove temporaries of `path` left by a writer that was killed (SIGKILL skips `finally`).

    Snakemake runs one job per output at a time, so no live writer owns them. A temporary's own
    temporaries count too (a writer given a temporary path, as an engine service is, writes
    through one of its own).
    """
    pattern = f".{glob.escape(path.name)}.*.tmp"
    for leftover in [*path.parent.glob(pattern), *path.parent.glob("." + pattern)]:
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; artifacts get the usual permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_dir(path):
    """Yield a temporary directory beside `path`; it replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~_umask())
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def write_json(path, obj):
    """Write `obj` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_torch(path, obj):
    """torch.save, atomically, with the same bytes for the same `obj` whatever the path.

    Given a path, torch.save names the archive's records after the file, here a random
    temporary name; given an open file it names them "archive" (docs/REBUILDING.md, "The same bytes on a rebuild").
    """
    import torch

    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)
