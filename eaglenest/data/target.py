"""The target model's files as the stages read them: config.json facts and named weights, without
loading the model. The one reader of the target's config (text part, rope, architectures)."""

import json
from pathlib import Path


def _config_json(target_dir):
    return json.loads((Path(target_dir) / "config.json").read_text())


def target_config(target_dir):
    """The target's config.json as a dict; for multimodal configs, the text model's part."""
    config = _config_json(target_dir)
    return config.get("text_config", config)


def target_architectures(target_dir):
    """The target's top-level `architectures` (what a drafter config names as its verifier)."""
    return _config_json(target_dir).get("architectures")


def target_dtype(target_dir):
    """The dtype the target's weights are stored in (config `dtype`, or the older `torch_dtype`),
    None when its config does not say."""
    config = target_config(target_dir)
    return config.get("dtype") or config.get("torch_dtype")


def rope_settings(config):
    """(rope_type, rope_theta) of a model config dict (a target's text config or a drafter's
    layer config): transformers 5's `rope_parameters`, older `rope_scaling`, or a top-level
    `rope_theta`; plain RoPE with theta 10000 when none is given."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return rope_type, float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def read_target_tensors(target_dir, names):
    """Tensors `names` of a HF checkpoint (model.safetensors or a sharded index), each matched
    exactly or after a prefix (e.g. `language_model.` of multimodal wrappers); absent names
    are left out."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
            weight_map = {key: "model.safetensors" for key in f.keys()}
    tensors = {}
    for name in names:
        matches = [key for key in weight_map if key == name or key.endswith("." + name)]
        if name in matches:
            matches = [name]
        if len(matches) > 1:
            raise ValueError(f"{name} is ambiguous in {target_dir}: {matches}")
        if matches:
            with safe_open(str(target_dir / weight_map[matches[0]]), framework="pt") as f:
                tensors[name] = f.get_tensor(matches[0])
    return tensors


def read_target_embedding(target_dir):
    """The target's input embedding [V, H] (model.embed_tokens.weight), which the drafter shares."""
    return read_target_tensors(target_dir, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
