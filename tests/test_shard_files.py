"""Per-shard slices of tokenized data and shard checksums: what shard-exact reruns rest on."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from eaglenest.workflow.atomic import atomic_path
from eaglenest.states.parts import part_paths, sha256_file, shard_of, split_tokenized
from eaglenest.states.shards import check_shard, check_shards, write_shard
from eaglenest.workflow.errors import InputError


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


def shard_sample(i, dtype):
    return {"id": f"s{i}", "input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.bool),
            "aux_hidden_states": torch.randn(5, 3 * 8).to(dtype), "final_hidden_states": torch.randn(5, 8).to(dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_changed_shard_is_found_by_its_content_sha256_and_removed(tmp_path, dtype):
    """Each shard carries the sha256 of its content; check_shard recomputes it in row blocks (the
    block size must not matter), and a shard that fails is removed, whatever broke it."""
    shards = [tmp_path / f"shard_{i}.safetensors" for i in range(4)]
    for i, shard in enumerate(shards):
        write_shard(shard, [shard_sample(2 * i, dtype), shard_sample(2 * i + 1, dtype)], hidden_size=8, dtype=dtype)
    manifest = {"shards": [{"file": s.name, "content_sha256": check_shard(s, rows_per_block=3)} for s in shards]}
    assert [check_shard(s) for s in shards] == [r["content_sha256"] for r in manifest["shards"]]
    with open(shards[1], "r+b") as f:
        f.truncate(shards[1].stat().st_size - 100)
    data = bytearray(shards[2].read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + header_size])["aux_hidden_states"]["data_offsets"]
    data[8 + header_size + (begin + end) // 2] ^= 0x01  # same size, a flipped bit in a hidden state
    shards[2].write_bytes(bytes(data))
    write_shard(shards[3], [shard_sample(0, dtype)], hidden_size=8, dtype=dtype)  # valid, but not what was recorded

    check_shards(shards[:1], manifest)
    with pytest.raises(InputError, match=r"shard_1\.safetensors: sha256 of its content unreadable .* run snakemake again"):
        check_shards(shards, manifest)
    assert not shards[1].exists() and shards[2].exists()  # removed as found, in order
    with pytest.raises(InputError, match=r"shard_2\.safetensors: sha256 of its content .* differs .* written when it was extracted"):
        check_shards(shards[2:], manifest)
    with pytest.raises(InputError, match=r"shard_3\.safetensors: sha256 of its content .* differs .* in the manifest"):
        check_shards(shards[3:], manifest)
    assert not shards[2].exists() and not shards[3].exists()
    with pytest.raises(InputError, match=r"shard_0\.safetensors: not in the manifest"):
        check_shards(shards[:1], {"shards": []})


def test_a_killed_writers_leftover_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "shard_00001.safetensors"
    leftover = tmp_path / ".shard_00001.safetensors.abc123.tmp"  # as a SIGKILLed atomic_path leaves it
    leftover.write_bytes(b"half")
    nested = tmp_path / "..shard_00001.safetensors.abc123.tmp.def456.tmp"  # a writer's through that temporary
    nested.write_bytes(b"half")
    other = tmp_path / ".shard_00002.safetensors.abc123.tmp"  # another output's: not ours to touch
    other.write_bytes(b"half")
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole" and not leftover.exists() and not nested.exists() and other.exists()
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


# write_shard killed (-9) inside safetensors' save_file, as a kill mid-extraction can land
KILLED_IN_SAVE = """
import os, signal, sys, torch
import eaglenest.states.shards as shards
save_file = shards.save_file
def save_then_die(tensors, filename, metadata=None):
    save_file(tensors, filename, metadata=metadata)
    os.kill(os.getpid(), signal.SIGKILL)
shards.save_file = save_then_die
shards.write_shard(sys.argv[1], [], hidden_size=8, dtype=torch.float32)
"""


def test_what_safetensors_writes_lives_where_the_next_write_of_the_shard_removes_it(tmp_path):
    """safetensors writes through a temporary of its own beside the file it is given (.tmpXXXXXX,
    renamed when done), GBs at Kimi's scale: write_shard gives it a file in a folder named as
    atomic_path's temporaries are, so a kill leaves nothing the shard's next write does not remove."""
    target = tmp_path / "shard_00001.safetensors"
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_SAVE, str(target)], cwd=REPO)
    assert killed.returncode == -signal.SIGKILL
    left = sorted(tmp_path.iterdir())
    assert left and all(re.fullmatch(r"\.shard_00001\.safetensors\.\w+\.tmp", p.name) for p in left)
    assert [p.name for folder in left if folder.is_dir() for p in folder.iterdir()] == ["shard"]
    write_shard(target, [], hidden_size=8, dtype=torch.float32)
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
