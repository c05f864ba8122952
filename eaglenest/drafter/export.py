"""Drafter checkpoints: write the speculators format, and the same drafter in the EAGLE/SGLang
format (reading either: eaglenest.drafter.load; docs/EXPORT.md). An mla
drafter is written in the one format vLLM 0.32 serves it from, a DeepSeek-V2 config naming
`Eagle3DeepseekV2ForCausalLM` (mla_config); it has no EAGLE/SGLang form (export_eagle).

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


MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


def mla_config(c, *, verifier_name_or_path, verifier_architectures):
    """config.json of an mla drafter (DrafterConfig `c`): the format vLLM 0.32 serves its
    `Eagle3DeepseekV2ForCausalLM` from. Not the speculators format: its eagle3 reader maps only
    llama and qwen3 layers to an architecture and refuses deepseek_v2
    (transformers_utils/configs/speculators/algos.py:39-46). A plain config as for EAGLE drafters,
    read by transformers' DeepseekV2Config and wrapped by vLLM's EAGLEConfig, which keeps an
    architecture starting with Eagle3 (configs/eagle.py:56-64). model_type must be deepseek_v2:
    deepseek_v3 would be rewritten to an MTP model (config/speculative.py:679-693). The aux layer
    ids at the top level, where vLLM looks first (v1/worker/gpu_model_runner.py:5268), and the two
    norm flags the layer reads (deepseek_eagle3.py:101, 222) written, though False is vLLM's default.
    `verifier` is ours (the pre-flight reads it; vLLM keeps it as an unused attribute)."""
    return {
        "architectures": [MLA_ARCHITECTURE],
        "model_type": "deepseek_v2",
        "vocab_size": c.target_vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_parameters": {**(c.rope_scaling or {"rope_type": "default"}), "rope_theta": c.rope_theta},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": c.norm_before_residual,
        "norm_output": c.norm_output,
        "verifier": {"name_or_path": str(verifier_name_or_path), "architectures": list(verifier_architectures)},
    }


def mla_export_problem(c):
    """Why vLLM 0.32 could not load an mla drafter of DrafterConfig `c`, or None. Its loader maps
    `kv_a_proj_with_mqa` into `fused_qkv_a_proj` unconditionally (deepseek_eagle3.py:258-267), a
    parameter the attention has only with a q_lora_rank (deepseek_v2.py:1051-1065: "There is no
    module or parameter named '...fused_qkv_a_proj'", tried); and the layer
    has no input_norm over the aux states (norm_before_fc), only fc_norm (deepseek_eagle3.py:211)."""
    if c.q_lora_rank is None:
        return "an mla drafter needs a q_lora_rank: vLLM 0.32 loads kv_a_proj_with_mqa only beside q_a_proj"
    if c.norm_before_fc:
        return "an mla drafter cannot have norm_before_fc: vLLM's Eagle3DeepseekV2ForCausalLM has no input_norm"
    return None


def write_drafter(
    drafter,
    directory,
    *,
    verifier_name_or_path,
    verifier_architectures,
    speculative_tokens,
    dtype=torch.bfloat16,
):
    """Write config.json + model.safetensors (speculators format; an mla drafter's: mla_config)
    into an existing directory.

    Floating weights are cast to `dtype`; d2t stays int64 offsets, t2d bool. embed_tokens is
    included: vLLM shares the target's embedding when they are equal, and needs our copy
    where it does not share (pipeline parallelism). When the draft vocab is the whole target
    vocab, vLLM has no d2t parameter and would reject one, so d2t/t2d are left out.
    Callers make it atomic (eaglenest.workflow.atomic.atomic_dir).
    """
    c = drafter.config
    if c.layer == "mla":
        if problem := mla_export_problem(c):
            raise ValueError(problem)
        config = mla_config(c, verifier_name_or_path=verifier_name_or_path, verifier_architectures=verifier_architectures)
    else:
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


# Written instead of a checkpoint where SGLang cannot serve the drafter as it was trained
NOT_FOR_SGLANG = "not_for_sglang.txt"


def sglang_mla_config(config):
    """An mla drafter's config.json (mla_config) for SGLang: its own `Eagle3DeepseekV2ForCausalLM`
    (sgl-project/sglang python/sglang/srt/models/kimi_k25_eagle3.py, read at commit 054a1ce) loads
    the same layout, `layers.0.*` renamed to its midlayer, q_a_proj and kv_a_proj_with_mqa fused, a
    q_lora_rank required, aux ids from eagle_config or the top level. Its layer always norms the
    hidden state after taking the residual: a drafter trained with norm_before_residual would be
    served as another, so it gets no config (None). SGLang's rope_theta and rope_scaling are added."""
    if config["norm_before_residual"]:
        return None
    rope_theta, rope_scaling = rope_settings(config)
    return {**config, "rope_theta": rope_theta,
            "rope_scaling": None if (rope_scaling or {}).get("rope_type", "default") == "default" else rope_scaling}


def export_eagle(drafter_dir, out_dir):
    """Rewrite a speculators-format drafter in the EAGLE/SGLang format: the same tensors, bit for
    bit, with the decoder layer under `midlayer.*`, and every flag vLLM would default written.
    An mla drafter keeps its one format, which SGLang reads too (sglang_mla_config); one SGLang
    cannot serve as trained gets, in place of a checkpoint, NOT_FOR_SGLANG saying why and what
    SGLang would need (vLLM serves it: results/drafter)."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    weights = load_file(str(Path(drafter_dir) / "model.safetensors"))
    if config.get("architectures") == [MLA_ARCHITECTURE]:
        if (config := sglang_mla_config(config)) is None:
            with atomic_dir(out_dir) as tmp:
                (tmp / NOT_FOR_SGLANG).write_text(
                    "SGLang's Eagle3DeepseekV2ForCausalLM (kimi_k25_eagle3.py) has no norm_before_residual: its layer "
                    "norms the hidden state after taking the residual, so it would serve this drafter as another. "
                    "Train it with drafter.norm_before_residual: false to serve it there; vLLM serves it as it is "
                    "(the drafter folder).\n")
            return
    else:
        config = eagle_config(config)
        weights = {name.replace("layers.0.", "midlayer."): tensor for name, tensor in weights.items()}
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
