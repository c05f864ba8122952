"""Drafter checkpoints: write the speculators format, and the same drafter in the EAGLE/SGLang
format (reading either: eaglenest.drafter.load; docs/CONVENTIONS.md, "Export formats").

Every config key below is read by vLLM's loaders (checked against vllm 0.32):
`transformers_utils/configs/speculators/algos.py::update_eagle3` (speculators format) and
`model_executor/models/llama_eagle3.py` (both formats), where the defaults differ:
`norm_before_residual` defaults to True for the speculators format but to False for the
EAGLE/SGLang format, so we always write it, and `norm_before_fc` and `norm_output` beside it
(both False by default in both; vLLM reads `norm_before_fc` from the EAGLE format's
`eagle_config` first, so it is written there too). The RoPE, scaling included, goes in the layer's
`rope_parameters` (what vLLM's `get_rope` reads); the EAGLE format adds SGLang's `rope_theta`
and `rope_scaling`.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglenest.data.target import rope_settings
from eaglenest.workflow.atomic import atomic_dir


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
        "rope_parameters": {**(c.rope_scaling or {"rope_type": "default"}), "rope_theta": c.rope_theta},
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
        "norm_before_fc": c.norm_before_fc,
        "norm_output": c.norm_output,
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
    Callers make it atomic (eaglenest.workflow.atomic.atomic_dir).
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
    """The EAGLE/SGLang config.json (vLLM's LlamaForCausalLMEagle3) of a speculators-format config.
    The RoPE in both shapes: `rope_parameters` for vLLM, `rope_theta` and `rope_scaling` (None for
    plain RoPE) for SGLang's Llama layer."""
    layer = speculators["transformer_layer_config"]
    rope_theta, rope_scaling = rope_settings(layer)
    return {
        **layer,
        "rope_theta": rope_theta,
        "rope_scaling": None if (rope_scaling or {}).get("rope_type", "default") == "default" else rope_scaling,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": speculators["draft_vocab_size"],
        "target_hidden_size": speculators["target_hidden_size"],
        "norm_before_residual": speculators["norm_before_residual"],
        "norm_before_fc": speculators["norm_before_fc"],
        "norm_output": speculators["norm_output"],
        "eagle_config": {
            "use_aux_hidden_state": True,
            "norm_before_fc": speculators["norm_before_fc"],
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
