"""Reading drafter checkpoints in either format vLLM loads: speculators (what training writes)
or EAGLE/SGLang (docs/EXPORT.md). Defaults follow vLLM's for each format."""

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from eaglenest.data.target import rope_settings
from eaglenest.drafter.export import MLA_ARCHITECTURE
from eaglenest.drafter.model import MLA_FIELDS, Drafter, DrafterConfig

# Options of vLLM's Eagle3 Llama drafter that ours does not implement: refuse, not ignore.
UNSUPPORTED_FLAGS = ("fc_norm", "attention_bias", "mlp_bias")
# The norm flags ours implements (DrafterConfig), with vLLM 0.32's default for the speculators
# format when the key is missing (update_eagle3); the EAGLE format defaults all three to False.
NORM_FLAGS = {"norm_before_residual": True, "norm_before_fc": False, "norm_output": False}


def _read_weights(directory):
    """All tensors of a checkpoint directory: its *.safetensors files, else pytorch_model.bin."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    state = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            state.update({name: f.get_tensor(name) for name in f.keys()})
    return state


def mla_settings(config):
    """(norm flags, aux layer ids, mla DrafterConfig fields) of an mla drafter's config.json
    (export.mla_config), as vLLM reads it: norm_before_fc False, its layer having no input_norm;
    model_type deepseek_v3 refused (vLLM would serve an MTP model)."""
    if config.get("model_type") != "deepseek_v2":
        raise ValueError(f"model_type {config.get('model_type')!r}: vLLM serves an EAGLE-3 mla drafter only as deepseek_v2 "
                         "(deepseek_v3 becomes an MTP model, config/speculative.py:679-693)")
    norms = {flag: config.get(flag, False) for flag in NORM_FLAGS}  # deepseek_eagle3.py:101, 222
    norms["norm_before_fc"] = False
    aux_layer_ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    mla = {"layer": "mla", **{name: config.get(name) for name in MLA_FIELDS},
           "head_dim": config.get("qk_rope_head_dim"), "num_key_value_heads": config["num_attention_heads"]}
    return norms, aux_layer_ids, mla


def read_checkpoint(path):
    """(DrafterConfig, state_dict with speculators names) from a drafter dir in either format.

    Speculators format: config has `speculators_model_type`, weights `layers.0.*`.
    EAGLE/SGLang format: a Llama config (`LlamaForCausalLMEagle3`), weights `midlayer.*`,
    aux ids under `eagle_config`. An mla drafter: a deepseek_v2 config naming
    Eagle3DeepseekV2ForCausalLM, weights `layers.0.*` (mla_settings). Defaults follow vLLM's for
    each format. A missing d2t means the draft vocab is the target vocab; a missing embed_tokens is
    left out of the state.
    The RoPE is the checkpoint's, scaling included: a type the drafter does not compute is a
    ValueError naming it.
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    mla = {}
    if config.get("model_type") in ("deepseek_v2", "deepseek_v3") or config.get("architectures") == [MLA_ARCHITECTURE]:
        layer = flags = config
        norms, aux_layer_ids, mla = mla_settings(config)
    elif "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"not an EAGLE-3 drafter: {config['speculators_model_type']}")
        layer = config["transformer_layer_config"]
        flags = {**layer, **config}
        norms = {flag: config.get(flag, default) for flag, default in NORM_FLAGS.items()}
        aux_layer_ids = config.get("eagle_aux_hidden_state_layer_ids")
    else:
        layer = flags = config
        eagle_config = config.get("eagle_config") or {}
        norms = {flag: config.get(flag, False) for flag in NORM_FLAGS}
        norms["norm_before_fc"] = eagle_config.get("norm_before_fc", norms["norm_before_fc"])  # vLLM: eagle_config's first
        aux_layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") or config.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if not eagle_config.get("use_aux_hidden_state", True):
            raise ValueError("drafter without aux hidden states (EAGLE-1 style) is not EAGLE-3")
    if unsupported := [name for name in UNSUPPORTED_FLAGS if flags.get(name)]:
        raise ValueError(f"drafter options not implemented here: {unsupported}")
    if layer.get("num_hidden_layers", 1) != 1 or layer.get("hidden_act", "silu") != "silu":
        raise ValueError("only one silu decoder layer is implemented")
    if aux_layer_ids is not None and len(aux_layer_ids) != 3:
        raise ValueError(f"EAGLE-3 needs 3 aux layer ids, got {aux_layer_ids}")

    hidden_size = layer["hidden_size"]
    rope_theta, rope_scaling = rope_settings(layer)
    num_heads = layer["num_attention_heads"]
    target_vocab_size = layer["vocab_size"]
    draft_vocab_size = config.get("draft_vocab_size") or target_vocab_size
    geometry = {"num_key_value_heads": layer.get("num_key_value_heads", num_heads),
                "head_dim": layer.get("head_dim") or hidden_size // num_heads, **mla}
    drafter_config = DrafterConfig(
        target_vocab_size=target_vocab_size,
        draft_vocab_size=draft_vocab_size,
        hidden_size=hidden_size,
        target_hidden_size=config.get("target_hidden_size") or hidden_size,
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=num_heads,
        **geometry,
        aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else None,
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=layer.get("max_position_embeddings", 32768),
        **{flag: bool(value) for flag, value in norms.items()},
    )

    state = {name.replace("midlayer.", "layers.0."): t for name, t in _read_weights(path).items()}
    if "d2t" not in state:
        if draft_vocab_size != target_vocab_size:
            raise ValueError("draft vocab smaller than the target vocab but no d2t")
        state["d2t"] = torch.zeros(draft_vocab_size, dtype=torch.int64)
    state["d2t"] = state["d2t"].to(torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[torch.arange(draft_vocab_size) + state["d2t"]] = True
    if "t2d" in state and not torch.equal(state["t2d"].to(torch.bool), t2d):
        raise ValueError("t2d disagrees with d2t")  # vLLM reads only d2t
    state["t2d"] = t2d
    return drafter_config, state


def drafter_from_state(config, state):
    """A Drafter of `config` holding `state`'s tensors themselves (assigned, not copied; no
    random init, so no [V, H] float32 embedding is ever drawn), in their dtypes."""
    with torch.device("meta"):
        drafter = Drafter(config)
    drafter.load_state_dict(state, assign=True)
    return drafter


def load_drafter(path, embed_tokens=None, config=None):
    """A Drafter (float32 but its frozen embed_tokens, eval mode) from a drafter dir in either format.

    Its own embed_tokens when the checkpoint has one (vLLM keeps a distinct one too), else
    `embed_tokens` [V, H], the target's (what vLLM shares then): either kept in its own dtype,
    and the tensor given is the drafter's, not a copy (at Kimi-K2.5's size a float32 copy is
    4.7 GB). `config`: a DrafterConfig to use instead of the checkpoint's (the weights must fit it).
    """
    file_config, state = read_checkpoint(path)
    if "embed_tokens.weight" not in state:
        if embed_tokens is None:
            raise ValueError(f"{path} has no embed_tokens: pass the target's")
        state["embed_tokens.weight"] = embed_tokens
    state = {n: t.float() if t.is_floating_point() and n != "embed_tokens.weight" else t for n, t in state.items()}
    return drafter_from_state(config or file_config, state).eval()


def as_served(drafter, dtype):
    """The drafter as vLLM computes it: every weight in the engine's dtype (vLLM loads the draft
    model in the target's model_config.dtype; activations follow), the vocab maps as they are.
    The drafter itself where that is float32."""
    if dtype == torch.float32:
        return drafter
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in drafter.state_dict().items()}
    return drafter_from_state(drafter.config, state).eval()


def load_drafter_copy(drafter, **changes):
    """`drafter` with DrafterConfig fields `changes` (e.g. a flipped norm flag): its weights, the
    embedding above all, shared rather than copied; vocab maps of its own (a misreading may change them)."""
    state = drafter.state_dict()
    state["d2t"], state["t2d"] = state["d2t"].clone(), state["t2d"].clone()
    return drafter_from_state(dataclasses.replace(drafter.config, **changes), state).eval()
