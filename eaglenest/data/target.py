"""The target model's files as the stages read them: config.json facts and named weights, without
loading the model. The one reader of the target's config (text part, rope, architectures).

A target is either a plain causal LM or a multimodal wrapper around one, as Kimi-K2.5 ships
(docs/KIMI.md): the text model's config is the wrapper's
`text_config`, and its tensors carry a prefix (`language_model.`) next to the vision tensors."""

import json
from pathlib import Path

EMBEDDING = "model.embed_tokens.weight"


def _config_json(target_dir):
    return json.loads((Path(target_dir) / "config.json").read_text())


def _config_parts(target_dir):
    """The text model's part of config.json, then the wrapper around it if there is one."""
    config = _config_json(target_dir)
    return [config["text_config"], config] if "text_config" in config else [config]


def _setting(target_dir, keys):
    """The first of `keys` that the text model's config sets (not null), else the first that the
    wrapper sets (Kimi-K2.5 states its dtype in both); None when neither does."""
    for part in _config_parts(target_dir):
        for key in keys:
            if part.get(key) is not None:
                return part[key]
    return None


def target_config(target_dir):
    """The target's config.json as a dict; for multimodal configs, the text model's part."""
    return _config_parts(target_dir)[0]


def target_is_wrapped(target_dir):
    """Whether the target is a multimodal wrapper around its text model (config `text_config`)."""
    return len(_config_parts(target_dir)) == 2


def target_architectures(target_dir):
    """The target's top-level `architectures` (what a drafter config names as its verifier)."""
    return _config_json(target_dir).get("architectures")


def target_dtype(target_dir):
    """The dtype the target's weights are stored in (config `dtype`, or the older `torch_dtype`, of
    the text model or else of its wrapper), None when its config does not say."""
    return _setting(target_dir, ("dtype", "torch_dtype"))


def target_ties_embeddings(target_dir):
    """Whether the config ties lm_head to embed_tokens: `tie_word_embeddings` of the text model,
    else of its wrapper, else untied. As in transformers, a checkpoint that has its own
    lm_head.weight is untied whatever this says (eaglenest.drafter.target_head)."""
    return bool(_setting(target_dir, ("tie_word_embeddings",)))


def rope_settings(config):
    """(rope_theta, rope_scaling) of a model config dict (a target's text config or a drafter's
    layer config), every key of its rope kept: transformers 5's `rope_parameters`, or the older
    `rope_scaling` beside a top-level `rope_theta`; theta 10000 when none is given, scaling None
    for plain RoPE given no keys. DrafterConfig refuses a scaling it does not compute."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    scaling = {key: value for key, value in params.items() if key != "rope_theta"}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0))), scaling or None


def _weight_map(target_dir):
    """{checkpoint key: file} of a HF checkpoint (model.safetensors or a sharded index)."""
    from safetensors import safe_open

    index = Path(target_dir) / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    with safe_open(str(Path(target_dir) / "model.safetensors"), framework="pt") as f:
        return {key: "model.safetensors" for key in f.keys()}


def _checkpoint_keys(target_dir, weight_map, names):
    """{name: its checkpoint key} for the `names` present, each matched exactly or after a prefix."""
    keys = {}
    for name in names:
        matches = [key for key in weight_map if key == name or key.endswith("." + name)]
        if name in matches:
            matches = [name]
        if len(matches) > 1:
            raise ValueError(f"{name} is ambiguous in {target_dir}: {matches}")
        if matches:
            keys[name] = matches[0]
    return keys


def read_target_tensors(target_dir, names):
    """Tensors `names` of a HF checkpoint (model.safetensors or a sharded index), each matched
    exactly or after a prefix (e.g. `language_model.` of multimodal wrappers); absent names
    are left out."""
    from safetensors import safe_open

    weight_map = _weight_map(target_dir)
    tensors = {}
    for name, key in _checkpoint_keys(target_dir, weight_map, names).items():
        with safe_open(str(Path(target_dir) / weight_map[key]), framework="pt") as f:
            tensors[name] = f.get_tensor(key)
    return tensors


def target_weight_prefix(target_dir):
    """What the checkpoint puts before the text model's tensor names: "" for a plain causal LM,
    "language_model." for Kimi-K2.5 (read off where model.embed_tokens.weight sits)."""
    keys = _checkpoint_keys(target_dir, _weight_map(target_dir), [EMBEDDING])
    if EMBEDDING not in keys:
        raise ValueError(f"{target_dir} has no {EMBEDDING}")
    return keys[EMBEDDING].removesuffix(EMBEDDING)


def target_embedding_bytes(target_dir):
    """Bytes per element of the target's stored embedding (the dtype TargetHead keeps it and the
    lm_head in), read off the safetensors header without loading it."""
    from safetensors import safe_open

    weight_map = _weight_map(target_dir)
    key = _checkpoint_keys(target_dir, weight_map, [EMBEDDING])[EMBEDDING]
    with safe_open(str(Path(target_dir) / weight_map[key]), framework="pt") as f:
        return {"BF16": 2, "F16": 2, "F32": 4}[f.get_slice(key).get_dtype()]


def read_target_embedding(target_dir):
    """The target's input embedding [V, H] (model.embed_tokens.weight), which the drafter shares."""
    return read_target_tensors(target_dir, [EMBEDDING])[EMBEDDING]
