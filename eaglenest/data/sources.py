"""The read_prompts stage: datasets in their own shapes and containers (data.sources), mixed,
written as one prompts file in eaglenest's shape ({"id", "messages"} per line) that
split_prompts and generation take as they take data.prompts.

Each source is read whole and checked before anything is written: a record of an unknown shape,
a role the chat template cannot take or an empty conversation fails the stage with one line
naming the file, the record and the field, as does a mixture that gives no prompt at all (naming
the sources and what each dropped), and the output appears only when every source was read
(atomically). What is kept and why the rest is not goes to a small JSON beside the prompts
(per source: records read, dropped by reason, prompts written), which the summary and the report
show.

Mixing is by record (a conversation keeps its turns together): a source with `count` gives that
many records, sources with `weight` share in those proportions as many records as they allow
(the largest mixture at which no weighted source runs out, whatever the others give), and a
source with neither gives all of its records. Which records a source gives
is decided by a hash of mix_seed and the record's id (the lowest hashes), not by drawing in file
order, so appending records to a source changes the choice by the records it gains or displaces
only, and generation redoes only the parts whose prompts changed. Kept records stay in source
order, then file order. Candidate prompts wait in a temporary file beside the output while the
sources are read, so memory holds ids, not conversations (BENCHMARKS.md "Reading prompt sources").
"""

import hashlib
import json
import logging
import tempfile
from fractions import Fraction
from math import floor
from pathlib import Path

from eaglenest.data.containers import read_records
from eaglenest.data.prompts import prompt_line
from eaglenest.data.shapes import canonical, conversation, detect_shape, prompts_of, record_id
from eaglenest.workflow.atomic import atomic_path, write_json
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)

DUPLICATE, NOTHING_TO_ANSWER, NOT_SAMPLED = "duplicate", "nothing to answer", "not sampled"


def _rank(seed, conversation_id):
    """A record's place in its source's sampling order: a hash of the seed and its id."""
    return hashlib.sha256(f"{seed}:{conversation_id}".encode()).digest()[:8]


class _Reader:
    """Reads sources one after another into a candidates file, keeping per source the ids of its
    records that gave prompts (with their number of lines) and what it dropped, and across
    sources every record id seen (with a digest of its messages) and every prompt id."""

    def __init__(self, candidates):
        self.candidates = candidates
        self.records_seen = {}  # record id -> (digest of its messages, where)
        self.prompt_ids = {}  # prompt id -> where

    def read(self, path, shape):
        """{"path", "shape", "records", "dropped"} and [(record id, lines)] of one source."""
        kept, dropped, count = [], {DUPLICATE: 0, NOTHING_TO_ANSWER: 0}, 0
        for where, record in read_records(path):
            count += 1
            if shape == "auto":
                shape = detect_shape(where, record)
            messages, tools = conversation(where, record, shape)
            conversation_id = record_id(where, record, messages, tools)
            digest = hashlib.sha256(canonical(messages, tools).encode()).digest()
            if conversation_id in self.records_seen:
                first_digest, first_where = self.records_seen[conversation_id]
                if first_digest != digest:
                    raise InputError(f"{where}: field 'id': {conversation_id!r} again, with other messages than at "
                                     f"{first_where}")
                dropped[DUPLICATE] += 1
                continue
            self.records_seen[conversation_id] = (digest, where)
            prompts = prompts_of(conversation_id, messages, shape)
            if not prompts:
                dropped[NOTHING_TO_ANSWER] += 1
                continue
            for prompt_id, prompt in prompts:
                if prompt_id in self.prompt_ids:
                    raise InputError(f"{where}: field 'id': its prompt id {prompt_id!r} is also the id of a prompt "
                                     f"at {self.prompt_ids[prompt_id]}")
                self.prompt_ids[prompt_id] = where
                line = json.dumps(prompt_line(prompt_id, prompt, tools), ensure_ascii=False) + "\n"
                self.candidates.write(line.encode())
            kept.append((conversation_id, len(prompts)))
        if not count:
            raise InputError(f"{path}: no records (empty)")
        return {"path": str(path), "shape": shape, "records": count, "dropped": dropped}, kept


def sample_sizes(available, sources):
    """Records to take from each source: its `count` (at most what it has), the weighted ones as
    many as their proportions allow (each at most what it has), the others all of theirs."""
    sizes = []
    for i, (have, source) in enumerate(zip(available, sources)):
        if source.get("count") is not None and source["count"] > have:
            raise InputError(f"config: data.sources[{i}].count: {source['count']} records asked of {source['path']}, "
                             f"which gives {have}")
        sizes.append(source["count"] if source.get("count") is not None else have)
    weights = {i: Fraction(source["weight"]) for i, source in enumerate(sources) if source.get("weight") is not None}
    if weights:
        total = sum(weights.values())
        mixture = min(floor(available[i] * total / weight) for i, weight in weights.items())
        for i, weight in weights.items():
            sizes[i] = min(available[i], floor(mixture * weight / total))
    return sizes


def _chosen(kept, size, seed):
    """The ids of the `size` records of `kept` [(record id, lines)] with the lowest ranks."""
    if size >= len(kept):
        return None  # all of them
    return set(sorted((record for record, _ in kept), key=lambda r: _rank(seed, r))[:size])


def read_sources(sources, prompts_out, counts_out, *, mix_seed):
    """The read_prompts stage: the records of `sources` (data.sources: [{path, shape, weight,
    count}], shape "auto" or absent: detected from the first record) mixed (sample_sizes, chosen
    by _rank) into `prompts_out` ({"id", "messages"} lines) and their counts into `counts_out`,
    both atomically; returns the counts."""
    prompts_out = Path(prompts_out)
    prompts_out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=prompts_out.parent, prefix=".candidates.") as candidates:
        reader = _Reader(candidates)
        read = [reader.read(source["path"], source.get("shape") or "auto") for source in sources]
        sizes = sample_sizes([len(kept) for _, kept in read], sources)
        if not any(sizes):  # each record taken gives a prompt: none taken, nothing to write
            raise InputError("config: data.sources: the mixture gives no prompt (" + "; ".join(
                f"{summary['path']}: {summary['records']} records, {len(kept)} giving prompts"
                + "".join(f", {n} dropped as {reason}" for reason, n in summary["dropped"].items() if n)
                for summary, kept in read) + ")")
        counts = []
        candidates.seek(0)
        with atomic_path(prompts_out) as tmp, open(tmp, "wb") as out:
            for (summary, kept), size in zip(read, sizes):
                chosen = _chosen(kept, size, mix_seed)
                written = 0
                for conversation_id, lines in kept:
                    block = b"".join(candidates.readline() for _ in range(lines))
                    if chosen is None or conversation_id in chosen:
                        out.write(block)
                        written += lines
                summary["dropped"][NOT_SAMPLED] = len(kept) - size
                counts.append({**summary, "used": size, "prompts": written})
                log.info("%s (%s): %d records, %d used, %d prompts; dropped %s", summary["path"], summary["shape"],
                         summary["records"], size, written, summary["dropped"])
    result = {"mix_seed": mix_seed, "prompts": sum(c["prompts"] for c in counts), "sources": counts}
    write_json(counts_out, result)
    return result
