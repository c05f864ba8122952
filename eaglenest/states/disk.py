"""The disk guard of the hidden_states stage: extraction writes ~57 KB per token at Kimi-K2.5's
width (1.2 TB for 21 M tokens), so a shard job refuses to start on a disk that cannot take the
shards still to write, instead of failing hours later on a full disk with a half-written file."""

import json
import shutil
from pathlib import Path

from eaglenest.workflow.errors import InputError

GB = 10**9


def existing_folder(path):
    """`path`, or its nearest ancestor that exists (where free space is read before it is made)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def check_free_disk(plan_path, shard_dir, margin_gb):
    """Refuse (InputError) when the free space where the shards go is below what the plan's
    hidden_states_bytes still needs, less the shards already on disk, plus `margin_gb`.
    Returns (free, needed) bytes."""
    planned = json.loads(Path(plan_path).read_text())["hidden_states_bytes"]
    written = sum(p.stat().st_size for p in Path(shard_dir).glob("shard_*.safetensors"))  # none if not made yet
    needed, margin = max(planned - written, 0), int(margin_gb * GB)
    folder = existing_folder(shard_dir)
    free = shutil.disk_usage(folder).free
    if free < needed + margin:
        raise InputError(
            f"{folder}: {free / GB:.2f} GB free, below the {(needed + margin) / GB:.2f} GB extraction needs "
            f"({needed / GB:.2f} GB of shards still to write, {plan_path} hidden_states_bytes, plus the "
            f"{margin_gb:g} GB margin of config hidden_states.free_disk_margin_gb)"
        )
    return free, needed
