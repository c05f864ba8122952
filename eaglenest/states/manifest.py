"""manifest.json: what the shards hold, in which convention, and each one's content sha256."""

import json
from pathlib import Path

from safetensors import safe_open

from eaglenest.data.target import target_config
from eaglenest.engine.service import stop_services
from eaglenest.states.convention import FINAL_STATE_CONVENTION, resolve_aux_layer_ids
from eaglenest.states.shards import check_shard
from eaglenest.workflow.atomic import write_json


def write_manifest(shard_paths, target_dir, manifest_path, *, aux_layer_ids, dtype):
    """Write the manifest of `shard_paths` (docs/CONTRACTS.md).

    Each shard is first held against the sha256 written into it when it was extracted, so a shard
    changed on disk since is removed (and re-extracted by the next run), never recorded as good.
    """
    stop_services("hidden_states")  # every shard is done: the engine frees its GPUs before training takes them
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


def read_manifest(path):
    """The manifest written by write_manifest."""
    return json.loads(Path(path).read_text())
