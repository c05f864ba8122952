"""Drafter checkpoints: write the speculators format, read it or the EAGLE/SGLang format.

Every config key below is read by vLLM's loaders (checked against vllm 0.32):
`transformers_utils/configs/speculators/algos.py::update_eagle3` (speculators format) and
`model_executor/models/llama_eagle3.py` (both formats), where the defaults differ:
`norm_before_residual` defaults to True for the speculators format but to False for the
EAGLE/SGLang format, so we always write it.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglenest.atomic import atomic_dir
from eaglenest.drafter import Drafter, DrafterConfig

# Options of vLLM's Eagle3 Llama drafter that ours does not implement: refuse, not ignore.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias")


def speculators_config(c, *, verifier_name_or_path, verifier_architectures, speculative_tokens):
    """config.json of the speculators format for DrafterConfig `c`."""
    layer = {
        "model_type": "llama",
        "vocab_size": c.target_vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": c.norm_before_residual,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": str(verifier_name_or_path),
                "architectures": list(verifier_architectures),
            },
        },
    }


def write_drafter(
    drafter,
    directory,
    *,
    verifier_name_or_path,
    verifier_architectures,
    speculative_tokens,
    dtype=torch.bfloat16,
):
    """Write config.json + model.safetensors (speculators format) into an existing directory.

    Floating weights are cast to `dtype`; d2t stays int64 offsets, t2d bool. embed_tokens is
    included: vLLM shares the target's embedding when they are equal, and needs our copy
    where it does not share (pipeline parallelism). When the draft vocab is the whole target
    vocab, vLLM has no d2t parameter and would reject one, so d2t/t2d are left out.
    Callers make it atomic (eaglenest.atomic.atomic_dir).
    """
    c = drafter.config
    config = speculators_config(
        c,
        verifier_name_or_path=verifier_name_or_path,
        verifier_architectures=verifier_architectures,
        speculative_tokens=speculative_tokens,
    )
    tensors = {}
    for name, tensor in drafter.state_dict().items():
        if name in ("d2t", "t2d") and c.draft_vocab_size == c.target_vocab_size:
            continue
        tensor = tensor.detach().cpu()
        tensors[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    directory = Path(directory)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def eagle_config(speculators):
    """The EAGLE/SGLang config.json (vLLM's LlamaForCausalLMEagle3) of a speculators-format config."""
    return {
        **speculators["transformer_layer_config"],
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": speculators["draft_vocab_size"],
        "target_hidden_size": speculators["target_hidden_size"],
        "norm_before_residual": speculators["norm_before_residual"],
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": speculators["eagle_aux_hidden_state_layer_ids"],
        },
    }


def export_eagle(drafter_dir, out_dir):
    """Rewrite a speculators-format drafter in the EAGLE/SGLang format: the same tensors, bit for
    bit, with the decoder layer under `midlayer.*`, and every flag vLLM would default written."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    weights = load_file(str(Path(drafter_dir) / "model.safetensors"))
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(eagle_config(config), indent=2) + "\n")
        renamed = {name.replace("layers.0.", "midlayer."): tensor for name, tensor in weights.items()}
        save_file(renamed, str(tmp / "model.safetensors"), metadata={"format": "pt"})


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


def _rope_theta(layer, require_plain_rope):
    """rope_theta of a Llama layer config; only plain RoPE is implemented by our drafter."""
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if require_plain_rope and rope_type != "default":
        raise ValueError(f"drafter uses rope_type {rope_type!r}; only plain RoPE is implemented")
    return float(rope.get("rope_theta", layer.get("rope_theta", 10000.0)))


def read_checkpoint(path, *, require_plain_rope=True):
    """(DrafterConfig, state_dict with speculators names) from a drafter dir in either format.

    Speculators format: config has `speculators_model_type`, weights `layers.0.*`.
    EAGLE/SGLang format: a Llama config (`LlamaForCausalLMEagle3`), weights `midlayer.*`,
    aux ids under `eagle_config`. Defaults follow vLLM's for each format. A missing d2t means
    the draft vocab is the target vocab; a missing embed_tokens is left out of the state.
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"not an EAGLE-3 drafter: {config['speculators_model_type']}")
        layer = config["transformer_layer_config"]
        flags = {**layer, **config}
        norm_before_residual = config.get("norm_before_residual", True)
        aux_layer_ids = config.get("eagle_aux_hidden_state_layer_ids")
    else:
        layer = flags = config
        norm_before_residual = config.get("norm_before_residual", False)
        eagle_config = config.get("eagle_config") or {}
        aux_layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") or config.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if not eagle_config.get("use_aux_hidden_state", True):
            raise ValueError("drafter without aux hidden states (EAGLE-1 style) is not EAGLE-3")
    if unsupported := [name for name in UNSUPPORTED_FLAGS if flags.get(name)]:
        raise ValueError(f"drafter options not implemented here: {unsupported}")
    if layer.get("num_hidden_layers", 1) != 1 or layer.get("hidden_act", "silu") != "silu":
        raise ValueError("only one silu Llama decoder layer is implemented")
    if aux_layer_ids is not None and len(aux_layer_ids) != 3:
        raise ValueError(f"EAGLE-3 needs 3 aux layer ids, got {aux_layer_ids}")

    hidden_size = layer["hidden_size"]
    num_heads = layer["num_attention_heads"]
    target_vocab_size = layer["vocab_size"]
    draft_vocab_size = config.get("draft_vocab_size") or target_vocab_size
    drafter_config = DrafterConfig(
        target_vocab_size=target_vocab_size,
        draft_vocab_size=draft_vocab_size,
        hidden_size=hidden_size,
        target_hidden_size=config.get("target_hidden_size") or hidden_size,
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=num_heads,
        num_key_value_heads=layer.get("num_key_value_heads", num_heads),
        head_dim=layer.get("head_dim") or hidden_size // num_heads,
        aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else None,
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(layer, require_plain_rope),
        max_position_embeddings=layer.get("max_position_embeddings", 32768),
        norm_before_residual=bool(norm_before_residual),
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


def load_drafter(path, embed_tokens=None, config=None):
    """A Drafter (float32, eval mode) from a drafter dir in either format.

    Its own embed_tokens when the checkpoint has one (vLLM keeps a distinct one too), else
    `embed_tokens` [V, H], the target's (what vLLM shares then). `config`: a DrafterConfig
    to use instead of the checkpoint's (the weights must fit it).
    """
    file_config, state = read_checkpoint(path)
    if "embed_tokens.weight" not in state:
        if embed_tokens is None:
            raise ValueError(f"{path} has no embed_tokens: pass the target's")
        state["embed_tokens.weight"] = embed_tokens
    drafter = Drafter(config or file_config)
    drafter.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in state.items()})
    return drafter.eval()
