"""Shard bookkeeping that needs no torch (the Snakefile imports it): which sample goes to which
shard, and the per-shard slices of tokenized data, the parts. (Shards check themselves:
eaglenest.states.shards.)

The `shard_samples` checkpoint splits tokenized_data.jsonl into one part per shard, so that
appending or editing samples re-extracts only the shards whose samples changed: how and why in
eaglenest.workflow.parts, which the generation parts use too.
"""

from eaglenest.workflow.jsonl import read_objects
from eaglenest.workflow.parts import part_of as shard_of
from eaglenest.workflow.parts import SIZES, part_paths, sha256_file, split_lines

__all__ = ["shard_of", "part_paths", "sha256_file", "split_tokenized", "read_part", "SIZES"]


def split_tokenized(tokenized_path, parts_dir, num_shards):
    """Write the samples of each shard (by shard_of) to its part in `parts_dir`, lines verbatim in
    file order, and each part's sha256 beside it (see part_paths), and the samples and tokens of
    every part (SIZES: what the disk guard sizes the shards still to write from). The folder is
    replaced whole."""
    counts = split_lines(tokenized_path, parts_dir, num_shards, tokens_of=lambda sample: len(sample["input_ids"]))
    return {"num_shards": num_shards, "samples_per_shard": counts}


def read_part(path):
    """The tokenized samples of one part, in order."""
    return list(read_objects(path))
