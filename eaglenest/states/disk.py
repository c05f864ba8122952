"""The disk guard of the hidden_states stage: extraction writes ~57 KB per token at Kimi-K2.5's
width (1.2 TB for 21 M tokens), so a shard job refuses to start on a disk that cannot take the
shards still to write, instead of failing hours later on a full disk with a half-written file.

It sizes them with the plan's arithmetic (shards.shard_bytes) from the samples and tokens that
shard_samples recorded per part (parts.SIZES), not from plan.json: an input edge from the plan
would either re-extract every shard whenever the plan changes, or, through ancient(), make
Snakemake 9 skip missing shards in the run that remakes the plan (docs/SNAKEMAKE.md)."""

import json
import shutil
from pathlib import Path

from eaglenest.states.parts import SIZES
from eaglenest.states.shards import shard_bytes
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.units import GB, size


def existing_folder(path):
    """`path`, or its nearest ancestor that exists (where free space is read before it is made)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def bytes_to_write(parts_dir, shard_dir, *, hidden_size, dtype, aux_layers):
    """Bytes of the shards not on disk yet (this job's own included: Snakemake removed it)."""
    sizes = json.loads((Path(parts_dir) / SIZES).read_text())
    return sum(shard_bytes(tokens, samples, hidden_size=hidden_size, dtype=dtype, aux_layers=aux_layers)
               for index, (samples, tokens) in enumerate(zip(sizes["records"], sizes["tokens"]))
               if not (Path(shard_dir) / f"shard_{index:05d}.safetensors").exists())


def check_free_disk(needed, shard_dir, margin_gb):
    """Refuse (InputError) when the free space where the shards go is below `needed` bytes
    plus `margin_gb`. Returns the free bytes."""
    folder = existing_folder(shard_dir)
    free, margin = shutil.disk_usage(folder).free, int(margin_gb * GB)
    if free < needed + margin:
        raise InputError(
            f"{folder}: {size(free)} free, below the {size(needed + margin)} extraction needs "
            f"({size(needed)} of shards still to write, as the plan sizes them, plus the {margin_gb:g} GB "
            "margin of config hidden_states.free_disk_margin_gb)"
        )
    return free
