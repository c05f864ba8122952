"""Hidden-state extraction with the HF transformers backend.

For every token we keep what EAGLE-3 training needs (REFERENCE.md §4):
  aux states   the residual stream ENTERING each aux layer k (vLLM's convention, = HF
               hidden_states[k]), concatenated [T, 3H];
  final state  the residual stream leaving the last layer, BEFORE the final norm [T, H]
               (target logits = lm_head(norm(final))).
Both are captured with forward hooks, so no other layer's state is ever materialised.
"""

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from eaglenest.atomic import write_json
from eaglenest.shard_files import read_part
from eaglenest.shards import check_shard, write_shard
from eaglenest.stage import InputError
from eaglenest.target import target_config

log = logging.getLogger(__name__)

FINAL_STATE_CONVENTION = "pre_norm"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_aux_layer_ids(num_layers):
    """vLLM's default aux layers for EAGLE-3: (2, N // 2, N - 3)."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(aux_layer_ids, num_layers):
    """The configured ids, or vLLM's default when None; checked: 3 distinct ids in [0, num_layers)."""
    ids = default_aux_layer_ids(num_layers) if aux_layer_ids is None else list(aux_layer_ids)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= k < num_layers for k in ids):
        raise InputError(
            f"config hidden_states.aux_layer_ids: must be 3 distinct layer ids in [0, {num_layers}), got {ids}"
        )
    return ids


def load_target(target_dir, dtype, device):
    """Load the target as an HF causal LM in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=DTYPES[dtype])
    return model.to(device).eval()


@torch.no_grad()
def capture_states(model, input_ids, aux_layer_ids):
    """Run one sequence [T] through `model`; return (aux [T, 3H], final [T, H])."""
    layers = model.model.layers
    captured = {}

    def keep_input(k):
        def hook(module, args, kwargs):
            captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def keep_output(module, args, output):
        captured["final"] = output[0] if isinstance(output, tuple) else output

    handles = [layers[k].register_forward_pre_hook(keep_input(k), with_kwargs=True) for k in aux_layer_ids]
    handles.append(layers[-1].register_forward_hook(keep_output))
    try:
        model.model(input_ids=input_ids[None].to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    aux = torch.cat([captured[k][0] for k in aux_layer_ids], dim=-1)
    return aux, captured["final"][0]


def extract_shard(target_dir, samples, shard_path, *, aux_layer_ids, dtype, device):
    """Extract hidden states of `samples` ({"id", "input_ids", "loss_mask"}) into one shard file."""
    model = load_target(target_dir, dtype, device)
    return extract_with(model, samples, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype)


def extract_with(model, samples, shard_path, *, aux_layer_ids, dtype):
    """extract_shard with the target already loaded (for many shards in one process)."""
    aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, model.config.num_hidden_layers)
    rows = []
    start, tokens = time.monotonic(), 0
    for i, sample in enumerate(samples, 1):
        input_ids = torch.tensor(sample["input_ids"], dtype=torch.int64)
        aux, final = capture_states(model, input_ids, aux_layer_ids)
        rows.append(
            {
                "id": sample["id"],
                "input_ids": input_ids,
                "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.bool),
                "aux_hidden_states": aux.to(DTYPES[dtype]).cpu(),
                "final_hidden_states": final.to(DTYPES[dtype]).cpu(),
            }
        )
        tokens += len(input_ids)
        if i % 50 == 0 or i == len(samples):
            rate = tokens / max(time.monotonic() - start, 1e-9)
            eta = (len(samples) - i) * (time.monotonic() - start) / i
            log.info("%s: %d/%d samples, %.0f tok/s, ETA %.0fs", shard_path, i, len(samples), rate, eta)
    write_shard(shard_path, rows, hidden_size=model.config.hidden_size, dtype=DTYPES[dtype])
    return {"num_samples": len(rows), "num_tokens": tokens}


def extract_shard_part(part_path, target_dir, shard_path, *, backend, aux_layer_ids, dtype, device, vllm):
    """The hidden_states stage for one shard: its part's samples, extracted into `shard_path`.

    backend "hf": transformers on `device`; "vllm": the target in vLLM with the `vllm` settings
    (tensor parallelism for targets one GPU cannot hold), see eaglenest/hidden_states_vllm.py.
    """
    samples = read_part(part_path)
    log.info("%s: %d samples, %s backend", part_path, len(samples), backend)
    if backend == "vllm":
        from eaglenest.hidden_states_vllm import extract_shard_vllm

        return extract_shard_vllm(target_dir, samples, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype, vllm=vllm)
    return extract_shard(target_dir, samples, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype, device=device)


def write_manifest(shard_paths, target_dir, manifest_path, *, aux_layer_ids, dtype):
    """manifest.json: what the shards hold, in which convention, and each one's content sha256.

    Each shard is first held against the sha256 written into it when it was extracted, so a shard
    changed on disk since is removed (and re-extracted by the next run), never recorded as good.
    """
    config = target_config(target_dir)
    shards = []
    for path in shard_paths:
        content_sha256 = check_shard(path)
        with safe_open(str(path), framework="pt") as f:
            sample_ids = json.loads(f.metadata()["sample_ids"])
            num_tokens = int(f.get_slice("input_ids").get_shape()[0])
        shards.append({"file": Path(path).name, "sample_ids": sample_ids, "num_tokens": num_tokens, "content_sha256": content_sha256})
    manifest = {
        "aux_layer_ids": resolve_aux_layer_ids(aux_layer_ids, config["num_hidden_layers"]),
        "final_state": FINAL_STATE_CONVENTION,
        "dtype": dtype,
        "hidden_size": config["hidden_size"],
        "num_layers": config["num_hidden_layers"],
        "target_vocab_size": config["vocab_size"],
        "shards": shards,
    }
    write_json(manifest_path, manifest)
    return manifest
