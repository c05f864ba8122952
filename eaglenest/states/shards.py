"""Packed hidden-state shards: many samples per safetensors file, kinder to file systems.

One shard holds, for its samples concatenated along the token axis:
  input_ids            int64 [T]
  loss_mask            bool  [T]      True on tokens the target generated
  offsets              int64 [n+1]    sample i spans offsets[i]:offsets[i+1]
  aux_hidden_states    dtype [T, 3H]  residual streams entering the aux layers (vLLM convention)
  final_hidden_states  dtype [T, H]   residual stream after the last layer, BEFORE the final norm
and the sample ids as JSON in the safetensors metadata (key "sample_ids").

Stored in float8_e4m3fn (config hidden_states.dtype), each of the two state tensors has a scale
per token beside it: aux_hidden_states_scale and final_hidden_states_scale, float32 [T], the row's
amax / 448 (e4m3's largest value), so a row is its FP8 values times its scale. Readers carry the
FP8 bytes and their scales to the device they compute on and dequantize there (dequantize_states).

A shard checks itself: it also holds content_sha256 (uint8 [32]), the sha256 of its sample ids
and other tensors taken when it was written, which check_shard recomputes from the file. It is a
tensor, not metadata, because safetensors writes metadata keys in a random order and shards must
be byte-reproducible. (A checksum file beside each shard would be one more Snakemake output per
shard, which slows every dry run at 1,000 shards: BENCHMARKS.md.)
"""

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglenest.states.convention import DTYPES
from eaglenest.workflow.atomic import atomic_path
from eaglenest.workflow.errors import InputError

STATE_KEYS = ("aux_hidden_states", "final_hidden_states")
TENSOR_KEYS = ("input_ids", "loss_mask", *STATE_KEYS)
SCALE_KEYS = tuple(f"{key}_scale" for key in STATE_KEYS)  # FP8 shards only
DIGEST_KEY = "content_sha256"
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def bytes_per_token(*, hidden_size, dtype, aux_layers=3):
    """A token's bytes in a shard of states stored in `dtype` (a config name, e.g. "bfloat16"):
    input_ids, loss_mask, its aux and final states, and in FP8 their two float32 scales."""
    scales = 4 * len(SCALE_KEYS) if DTYPES[dtype] == FP8 else 0
    return 8 + 1 + (aux_layers + 1) * hidden_size * DTYPES[dtype].itemsize + scales


def shard_bytes(tokens, samples, *, hidden_size, dtype, aux_layers=3):
    """The bytes of a shard of `samples` samples and `tokens` tokens, as write_shard lays it out
    (the safetensors header and sample ids aside): the plan's hidden_states_bytes."""
    per_token = bytes_per_token(hidden_size=hidden_size, dtype=dtype, aux_layers=aux_layers)
    return tokens * per_token + 8 * (samples + 1) + 32  # offsets, content_sha256


def quantize_fp8(states):
    """states [..., D] in any float dtype, on any device -> (FP8 [..., D], float32 scale [...]):
    each row divided by its amax / 448, so its largest value lands on e4m3's largest; the scale
    is clamped away from 0, so a row of zeros stays zeros. Computed in float32 (one rounding)."""
    scale = (states.abs().amax(-1).float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (states.float() / scale[..., None]).to(FP8), scale


def dequantize_states(batch, dtype):
    """`batch` (a sample or a collated batch) with each FP8 state tensor, times its scale, in
    `dtype` and the scales dropped; states stored in another dtype are left as they are. Called
    where the batch is computed on, so host memory and the copy there carry the FP8 bytes."""
    out = {key: value for key, value in batch.items() if key not in SCALE_KEYS}
    for key, scale in zip(STATE_KEYS, SCALE_KEYS):
        if scale in batch:
            out[key] = batch[key].to(dtype) * batch[scale].to(dtype)[..., None]
    return out


def stored(sample, dtype):
    """A sample's tensors as a shard of states in torch `dtype` stores them: the states cast, or in
    FP8 quantized with their scales (unless the backend already did, on its device)."""
    out = dict(sample)
    for key, scale in zip(STATE_KEYS, SCALE_KEYS):
        if dtype != FP8:
            out[key] = sample[key].to(dtype)
        elif scale not in sample:
            out[key], out[scale] = quantize_fp8(sample[key])
    return out


def write_shard(path, samples, *, hidden_size, dtype, aux_layers=3):
    """Pack `samples` (dicts with "id" and TENSOR_KEYS, and SCALE_KEYS if already quantized)
    into one shard file of states in torch `dtype`, atomically.

    hidden_size and dtype give the tensor shapes of an empty shard (a shard no sample hashed to);
    aux_layers: how many layers' states aux_hidden_states concatenates (3 for a drafter's).
    """
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    empty = {
        "input_ids": torch.zeros(0, dtype=torch.int64),
        "loss_mask": torch.zeros(0, dtype=torch.bool),
        "aux_hidden_states": torch.zeros(0, aux_layers * hidden_size, dtype=dtype),
        "final_hidden_states": torch.zeros(0, hidden_size, dtype=dtype),
    }
    if dtype == FP8:
        empty |= {scale: torch.zeros(0, dtype=torch.float32) for scale in SCALE_KEYS}
    rows = [stored(s, dtype) for s in samples]
    tensors = {key: torch.cat([empty[key]] + [row[key].cpu().to(empty[key].dtype) for row in rows]) for key in empty}
    tensors["offsets"] = offsets
    sample_ids = json.dumps([s["id"] for s in samples])
    digest = _content_digest(sample_ids)
    for key in sorted(tensors):
        _digest_tensor(digest, key, tensors[key])
    tensors[DIGEST_KEY] = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
    # safetensors writes through a temporary of its own beside the file it is given (.tmpXXXXXX, then a
    # rename), which a kill would leave behind, GBs a shard: given a file in a folder named as ours are, the
    # next write of this shard removes it with its folder (atomic_path's leftovers)
    with atomic_path(path) as tmp, tempfile.TemporaryDirectory(prefix=f".{Path(path).name}.", suffix=".tmp",
                                                               dir=tmp.parent) as folder:
        save_file(tensors, os.path.join(folder, "shard"), metadata={"sample_ids": sample_ids})
        os.replace(os.path.join(folder, "shard"), tmp)


def _content_digest(sample_ids):
    return hashlib.sha256(sample_ids.encode() + b"\0")


def _digest_tensor(digest, key, tensor, first_row=0):
    """Feed one tensor (or rows of it, from `first_row`) to `digest`: its name, dtype and shape
    once, then its bytes, so reading it back in row blocks gives the same digest."""
    if first_row == 0:
        digest.update(f"{key}\0{tensor.dtype}\0{list(tensor.shape[1:])}\0".encode())
    digest.update(tensor.contiguous().view(torch.uint8).numpy())


def check_shard(path, sha256=None, rows_per_block=4096):
    """The shard's content sha256, recomputed from the file, after checking it against the one
    written into it and against `sha256` (the manifest's) when given.

    A shard that fails, or that safetensors cannot read (truncated, a corrupt header), is removed
    and InputError raised: the next run re-extracts exactly that shard, and no reader sees it.
    Tensors are read in row blocks, so memory holds a block, not a shard.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            recorded = bytes(f.get_tensor(DIGEST_KEY).numpy()).hex()
            digest = _content_digest(f.metadata()["sample_ids"])
            for key in sorted(set(f.keys()) - {DIGEST_KEY}):
                rows = f.get_slice(key).get_shape()[0]
                for start in range(0, max(rows, 1), rows_per_block):
                    _digest_tensor(digest, key, f.get_slice(key)[start : start + rows_per_block], start)
        actual = digest.hexdigest()
        problem = None if actual == recorded else f"{actual[:12]}... differs from the {recorded[:12]}... written when it was extracted"
    except Exception as e:  # safetensors raises its own error types for a damaged file
        problem = f"unreadable ({type(e).__name__}: {e})"
    if problem is None and sha256 is not None and actual != sha256:
        problem = f"{actual[:12]}... differs from the {sha256[:12]}... in the manifest"
    if problem is not None:
        os.unlink(path)
        raise InputError(
            f"{path}: sha256 of its content {problem} (corrupt on disk); removed it: "
            "run snakemake again to re-extract that shard only"
        )
    return actual


def check_shards(shard_paths, manifest):
    """check_shard for every shard against the content sha256 the manifest recorded: before any reader."""
    recorded = {shard["file"]: shard["content_sha256"] for shard in manifest["shards"]}
    for path in shard_paths:
        if Path(path).name not in recorded:
            raise InputError(f"{path}: not in the manifest, so not extracted with these settings")
        check_shard(path, recorded[Path(path).name])


class ShardSamples:
    """Random access to the samples of packed shards whose id passes `keep`.

    Each sample is read with safetensors slices, so memory holds one batch, not one shard,
    and a global shuffle costs no more than a sequential pass.
    """

    def __init__(self, shard_paths, keep=lambda sample_id: True):
        self.index = []  # (path, start, end, sample id)
        self.keys = {}  # path -> the sample tensors it holds (the scales in FP8 shards)
        for path in shard_paths:
            with safe_open(str(path), framework="pt") as f:
                ids = json.loads(f.metadata()["sample_ids"])
                offsets = f.get_tensor("offsets").tolist()
                self.keys[str(path)] = [key for key in TENSOR_KEYS + SCALE_KEYS if key in f.keys()]
            for i, sample_id in enumerate(ids):
                if keep(sample_id):
                    self.index.append((str(path), offsets[i], offsets[i + 1], sample_id))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        path, start, end, sample_id = self.index[i]
        with safe_open(path, framework="pt") as f:
            sample = {key: f.get_slice(key)[start:end] for key in self.keys[path]}
        sample["id"] = sample_id
        return sample

    def num_tokens(self):
        return sum(end - start for _, start, end, _ in self.index)


def read_shard(path):
    """All samples of one shard, in order."""
    samples = ShardSamples([path])
    return [samples[i] for i in range(len(samples))]


def collate(samples):
    """Right-pad samples into one batch: input_ids [B, T], loss_mask [B, T] (False on padding),
    aux_hidden_states [B, T, 3Ht] and final_hidden_states [B, T, H] in their stored dtype (bf16
    or FP8 at scale: a half or a quarter of float32's bytes to pad, pin and move; the step casts,
    or dequantizes with the scales [B, T] also here, on its device)."""
    T = max(len(s["input_ids"]) for s in samples)
    batch = {}
    for key in [key for key in samples[0] if key != "id"]:
        first = samples[0][key]
        out = torch.zeros(len(samples), T, *first.shape[1:], dtype=first.dtype)
        for i, s in enumerate(samples):
            out[i, : len(s[key])] = s[key]
        batch[key] = out
    return batch


def budget_batches(indices, lengths, max_tokens):
    """`indices`, in order, cut into runs whose count × longest length stays within max_tokens
    (a sample longer than that alone)."""
    batches, batch, longest = [], [], 0
    for i in indices:
        if batch and (len(batch) + 1) * max(longest, lengths[i]) > max_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, lengths[i])
    return batches + [batch] if batch else batches


def length_batches(indices, lengths, max_tokens, window=None):
    """Batches of sample indices by token budget, for training (eaglenest.train.batches) and
    evaluate_offline: budget_batches of `indices` sorted by length within consecutive windows of
    `window` samples (None: all in one), so little is padding; ties keep their order."""
    indices = list(indices)
    window = window or max(len(indices), 1)
    batches = []
    for start in range(0, len(indices), window):
        batches += budget_batches(sorted(indices[start : start + window], key=lengths.__getitem__), lengths,
                                  max_tokens)
    return batches
