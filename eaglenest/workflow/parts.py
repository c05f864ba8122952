"""Parts: one JSONL input cut into slices by a hash of each record's id, so that a job per slice
redoes only its own slice (stdlib only: the Snakefile imports this). The hidden-state shards
(eaglenest.states.parts) and the generation parts (eaglenest.data.generate) rest on it.

Why parts: Snakemake reruns a job when an input is newer than its output. If every job read the
whole input, appending one record would redo every job. Instead a checkpoint writes, in one
folder, part_NNNNN.jsonl (the part's records, lines verbatim in file order) and part_NNNNN.sha256
(its digest, a few bytes). One folder, not 2 x num_parts declared outputs: Snakemake matches every
input against every output of a rule, which made a dry run at 1,000 shards much slower
(BENCHMARKS.md). A job depends on its part through `ancient()` and on the digest normally: the
digest is rewritten with a new mtime but, being tiny, its checksum is compared (Snakemake does
that for inputs under --max-checksum-file-size), so only the jobs whose records really changed
rerun. The checkpoint makes Snakemake re-decide after the split has run, within the same
invocation. A record goes to a part by a hash of its id, so appending records never moves an old
one to another part.
"""

import hashlib
import json
from pathlib import Path

from eaglenest.workflow.atomic import atomic_dir
from eaglenest.workflow.jsonl import jsonl_lines


SIZES = "sizes.json"  # {"records": [...], "tokens": [...]} per part, when split_lines counts tokens


def part_of(record_id, num_parts):
    """Part index of a record: a hash of its id, so appending records never moves old ones."""
    return int(hashlib.sha256(record_id.encode()).hexdigest()[:12], 16) % num_parts


def sha256_file(path):
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def part_paths(parts_dir, index):
    """(records, digest) file paths of one part in a split folder."""
    return Path(parts_dir) / f"part_{index:05d}.jsonl", Path(parts_dir) / f"part_{index:05d}.sha256"


def split_lines(path, parts_dir, num_parts, record_id=lambda where, obj: obj["id"], tokens_of=None):
    """Write each record of the JSONL file `path` to its part in `parts_dir` (part_of its id,
    `record_id(where, obj)`), lines verbatim in file order (a last line without its newline gets
    one), and each part's sha256 beside it (see part_paths). The folder is replaced whole; every
    part is written, empty ones too. Returns the number of records per part. tokens_of(obj):
    a record's tokens, whose sum per part goes to SIZES in the folder with the record counts."""
    parts = [[] for _ in range(num_parts)]
    tokens = [0] * num_parts
    for where, line, obj in jsonl_lines(path):
        index = part_of(record_id(where, obj), num_parts)
        parts[index].append(line.encode() if line.endswith("\n") else (line + "\n").encode())
        tokens[index] += tokens_of(obj) if tokens_of else 0
    counts = [len(lines) for lines in parts]
    with atomic_dir(parts_dir) as tmp:
        for index, lines in enumerate(parts):
            part, digest = part_paths(tmp, index)
            part.write_bytes(b"".join(lines))
            digest.write_text(sha256_file(part) + "\n")
        if tokens_of:
            (Path(tmp) / SIZES).write_text(json.dumps({"records": counts, "tokens": tokens}) + "\n")
    return counts
