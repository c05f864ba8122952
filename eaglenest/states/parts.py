"""Shard bookkeeping that needs no torch (the Snakefile imports it): which sample goes to which
shard, and the per-shard slices of tokenized data, the parts. (Shards check themselves:
eaglenest.states.shards.)

Why parts: Snakemake reruns a job when an input is newer than its output. If every shard read
tokenized_data.jsonl, appending one sample would re-extract every shard. Instead the
`shard_samples` checkpoint writes, in one folder, part_NNNNN.jsonl (the shard's samples, lines
verbatim) and part_NNNNN.sha256 (its digest, a few bytes). One folder, not 2 x num_shards
declared outputs: Snakemake matches every input against every output of a rule, which made a
dry run at 1,000 shards much slower (BENCHMARKS.md). A shard job depends on the part through
`ancient()` and on the digest normally: the digest is rewritten with a new mtime but, being tiny,
its checksum is compared (Snakemake does that for inputs under --max-checksum-file-size), so only
shards whose samples really changed are re-extracted. The checkpoint makes Snakemake re-decide
after the split has run, within the same invocation.
"""

import hashlib
from pathlib import Path

from eaglenest.workflow.atomic import atomic_dir
from eaglenest.workflow.jsonl import jsonl_lines, read_objects


def shard_of(sample_id, num_shards):
    """Shard index of a sample: a hash of its id, so appending samples never moves old ones."""
    return int(hashlib.sha256(sample_id.encode()).hexdigest()[:12], 16) % num_shards


def sha256_file(path):
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def part_paths(parts_dir, shard):
    """(samples, digest) file paths of one shard's part in the shard_samples folder."""
    return Path(parts_dir) / f"part_{shard:05d}.jsonl", Path(parts_dir) / f"part_{shard:05d}.sha256"


def split_tokenized(tokenized_path, parts_dir, num_shards):
    """Write the samples of each shard (by shard_of) to its part in `parts_dir`, lines verbatim in
    file order, and each part's sha256 beside it (see part_paths). The folder is replaced whole."""
    parts = [[] for _ in range(num_shards)]
    for _, line, sample in jsonl_lines(tokenized_path):
        parts[shard_of(sample["id"], num_shards)].append(line.encode())
    with atomic_dir(parts_dir) as tmp:
        for shard, lines in enumerate(parts):
            part, digest = part_paths(tmp, shard)
            part.write_bytes(b"".join(lines))
            digest.write_text(sha256_file(part) + "\n")
    return {"num_shards": num_shards, "samples_per_shard": [len(lines) for lines in parts]}


def read_part(path):
    """The tokenized samples of one part, in order."""
    return list(read_objects(path))
