"""Packed hidden-state shards: many samples per safetensors file, kinder to file systems.

One shard holds, for its samples concatenated along the token axis:
  input_ids            int64 [T]
  loss_mask            bool  [T]      True on tokens the target generated
  offsets              int64 [n+1]    sample i spans offsets[i]:offsets[i+1]
  aux_hidden_states    dtype [T, 3H]  residual streams entering the aux layers (vLLM convention)
  final_hidden_states  dtype [T, H]   residual stream after the last layer, BEFORE the final norm
and the sample ids as JSON in the safetensors metadata (key "sample_ids").
"""

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglenest.atomic import atomic_path

TENSOR_KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states")


def write_shard(path, samples, *, hidden_size, dtype):
    """Pack `samples` (dicts with "id" and TENSOR_KEYS) into one shard file, atomically.

    hidden_size and dtype give the tensor shapes of an empty shard (a shard no sample hashed to).
    """
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    empty = {
        "input_ids": torch.zeros(0, dtype=torch.int64),
        "loss_mask": torch.zeros(0, dtype=torch.bool),
        "aux_hidden_states": torch.zeros(0, 3 * hidden_size, dtype=dtype),
        "final_hidden_states": torch.zeros(0, hidden_size, dtype=dtype),
    }
    tensors = {key: torch.cat([empty[key]] + [s[key].to(empty[key].dtype) for s in samples]) for key in TENSOR_KEYS}
    tensors["offsets"] = offsets
    metadata = {"sample_ids": json.dumps([s["id"] for s in samples])}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


class ShardSamples:
    """Random access to the samples of packed shards whose id passes `keep`.

    Each sample is read with safetensors slices, so memory holds one batch, not one shard,
    and a global shuffle costs no more than a sequential pass.
    """

    def __init__(self, shard_paths, keep=lambda sample_id: True):
        self.index = []  # (path, start, end, sample id)
        for path in shard_paths:
            with safe_open(str(path), framework="pt") as f:
                ids = json.loads(f.metadata()["sample_ids"])
                offsets = f.get_tensor("offsets").tolist()
            for i, sample_id in enumerate(ids):
                if keep(sample_id):
                    self.index.append((str(path), offsets[i], offsets[i + 1], sample_id))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        path, start, end, sample_id = self.index[i]
        with safe_open(path, framework="pt") as f:
            sample = {key: f.get_slice(key)[start:end] for key in TENSOR_KEYS}
        sample["id"] = sample_id
        return sample

    def num_tokens(self):
        return sum(end - start for _, start, end, _ in self.index)


def read_shard(path):
    """All samples of one shard, in order."""
    samples = ShardSamples([path])
    return [samples[i] for i in range(len(samples))]

