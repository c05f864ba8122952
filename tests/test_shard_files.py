"""Per-shard slices of tokenized data and shard checksums: what shard-exact reruns rest on."""

import json
import os

import pytest

from eaglenest.atomic import atomic_path
from eaglenest.shard_files import (
    check_shards,
    part_paths,
    sha256_file,
    shard_of,
    split_tokenized,
    write_shard_sum,
)
from eaglenest.stage import InputError


def sample(i):
    return {"id": f"s{i}", "input_ids": [1, 2, i], "loss_mask": [0, 1, 1]}


def split(tmp_path, samples, num_shards=4):
    data = tmp_path / "tokenized_data.jsonl"
    data.write_text("".join(json.dumps(s) + "\n" for s in samples))
    split_tokenized(data, tmp_path / "shards", num_shards)
    paths = [part_paths(tmp_path / "shards", i) for i in range(num_shards)]
    return [part for part, _ in paths], [digest for _, digest in paths]


def test_parts_hold_each_shards_lines_verbatim_and_their_digest(tmp_path):
    samples = [sample(i) for i in range(40)]
    parts, digests = split(tmp_path, samples)
    for i, (part, digest) in enumerate(zip(parts, digests)):
        expected = [json.dumps(s) + "\n" for s in samples if shard_of(s["id"], 4) == i]
        assert part.read_text() == "".join(expected) and expected
        assert digest.read_text() == sha256_file(part) + "\n"


def test_appending_a_sample_changes_the_digest_of_its_shard_only(tmp_path):
    samples = [sample(i) for i in range(40)]
    _, digests = split(tmp_path, samples)
    before = [d.read_text() for d in digests]
    _, digests = split(tmp_path, samples + [sample(40)])
    changed = [i for i, d in enumerate(digests) if d.read_text() != before[i]]
    assert changed == [shard_of("s40", 4)]


def test_a_changed_shard_is_found_by_sha256_and_removed(tmp_path):
    shards = [tmp_path / f"shard_{i}.safetensors" for i in range(3)]
    sums = [tmp_path / f"shard_{i}.sum.json" for i in range(3)]
    for shard, sum_path in zip(shards, sums):
        shard.write_bytes(os.urandom(1000))
        write_shard_sum(shard, sum_path)
    manifest = {"shards": [json.loads(s.read_text()) for s in sums]}
    with open(shards[1], "r+b") as f:
        f.truncate(600)

    data = bytearray(shards[2].read_bytes())
    data[500] ^= 0xFF  # same size, different bytes: only the checksum tells
    shards[2].write_bytes(bytes(data))
    check_shards(shards[:1], manifest)
    with pytest.raises(InputError, match=r"shard_1\.safetensors: sha256 .* differs .* run snakemake again"):
        check_shards(shards, manifest)
    assert not shards[1].exists() and shards[2].exists()  # removed as found, in order
    with pytest.raises(InputError, match=r"shard_2\.safetensors: sha256"):
        check_shards(shards[2:], manifest)
    assert not shards[2].exists()
    with pytest.raises(InputError, match=r"shard_0\.safetensors: not in the manifest"):
        check_shards(shards[:1], {"shards": []})


def test_a_killed_writers_leftover_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "shard_00001.safetensors"
    leftover = tmp_path / ".shard_00001.safetensors.abc123.tmp"  # as a SIGKILLed atomic_path leaves it
    leftover.write_bytes(b"half")
    other = tmp_path / ".shard_00002.safetensors.abc123.tmp"  # another output's: not ours to touch
    other.write_bytes(b"half")
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole" and not leftover.exists() and other.exists()
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
