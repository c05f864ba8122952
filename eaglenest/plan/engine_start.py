"""Engine-start failures caught before the hours: whether vLLM can start the target with the
drafter at all, from the target's config.json and the settings alone (rule engine_start_check),
before generation, the first vLLM stage (5.3 h at Kimi-K2.5's scale), runs.

The drafter engines (vllm_speculative) are the last vLLM stages, and the first to load the
drafter's attention beside the target's. Both layers' KV caches are cut into blocks of one size,
so the backend vLLM picks for the target's attention and the one it picks for the drafter's
must share a block size, or the engine dies at start ("No common block size for 128 (CPU_MLA:
[16]; CPU_ATTN: [MultipleOf(32)])": vllm/v1/worker/utils.py, select_common_block_size). Which
backends, and what they accept, is read from vLLM itself, never from a list of ours:

- the backend of each layer: the platform's own selector (`current_platform.get_attn_backend_cls`,
  as vllm/v1/attention/selector.py calls it) with the layer's MLA-ness and head size, the
  engine's dtype (vLLM's own resolution of "auto") and the configured vllm.attention_backend,
  which the drafter's layers inherit too (vllm/config/speculative.py, _DRAFT_VLLM_CONFIG_OVERRIDES:
  only a speculative_config.attention_backend would set theirs apart). A selected backend that
  does not fit a layer is vLLM's ValueError at start (on CUDA a TRITON_MLA for the Llama drafter's
  layer: "non-MLA not supported");
- whether a backend takes the dtype (`supports_dtype`: AMX_MLA only bfloat16);
- a block size both accept: vLLM's `_preferred_block_size_for_backends` over their declared
  `get_supported_kernel_block_sizes` (platforms/interface.py), which raises where none is shared.

The drafter's layer is config drafter.layer: `gqa` (Llama attention, Eagle3LlamaForCausalLM) or
`mla` (MLA like the target's, Eagle3DeepseekV2ForCausalLM). A failure names what would start:
the same check with the drafter layer, the dtype or the attention backend changed, one at a time.
"""

import logging

import torch

from eaglenest.data.target import target_config
from eaglenest.train.init_drafter import default_layer, target_geometry
from eaglenest.workflow.atomic import write_json
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)

DRAFTER_LAYERS = ("gqa", "mla")


def engine_dtype(text_config, dtype):
    """The dtype vLLM computes in for `dtype` (vllm.dtype; "auto": vLLM's own resolution from
    the config's, config/model.py _resolve_auto_dtype)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    from vllm.config.model import _resolve_auto_dtype

    stored = text_config.get("torch_dtype") or text_config.get("dtype") or "float32"
    return _resolve_auto_dtype(text_config.get("model_type", ""), getattr(torch, stored), is_pooling_model=False)


def mla_head_size(config):
    """The head size vLLM's MLA attention is built with: kv_lora_rank + qk_rope_head_dim (the latent
    cache entry per token)."""
    return config["kv_lora_rank"] + config["qk_rope_head_dim"]


def layer_backend(*, use_mla, head_size, dtype, kv_cache_dtype, attention_backend):
    """The attention backend class vLLM's platform selector picks for one layer (ValueError where
    the selected backend does not fit it or none does)."""
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    selected = AttentionBackendEnum[attention_backend.upper()] if attention_backend else None
    config = AttentionSelectorConfig(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=None,
                                     use_mla=use_mla)
    return resolve_obj_by_qualname(current_platform.get_attn_backend_cls(selected, config))


def shared_block_size(backends):
    """The block size vLLM would give layers of all `backends` (its _preferred_block_size_for_backends:
    the smallest each declares it supports); ValueError naming each one's sizes where none is shared."""
    from vllm.config import VllmConfig
    from vllm.config.cache import CacheConfig
    from vllm.platforms import current_platform

    return current_platform._preferred_block_size_for_backends(list(backends), CacheConfig.DEFAULT_BLOCK_SIZE,
                                                               VllmConfig())


def engine_start_problem(text_config, *, dtype, kv_cache_dtype, attention_backend, drafter_layer, drafter_head_dim):
    """Why vLLM could not start the target (`text_config`, its config.json's text model) with a
    drafter of layer `drafter_layer`, as a sentence, or None, and what it would pick:
    (problem, {"target": backend name, "drafter": ..., "block_size": n})."""
    target_mla = text_config.get("kv_lora_rank") is not None
    computed = engine_dtype(text_config, dtype)
    layers = {"target": (target_mla, mla_head_size(text_config) if target_mla else target_geometry(text_config)["head_dim"]),
              "drafter": (True, mla_head_size(text_config)) if drafter_layer == "mla" else (False, drafter_head_dim)}
    picked = {}
    for name, (use_mla, head_size) in layers.items():
        try:
            picked[name] = layer_backend(use_mla=use_mla, head_size=head_size, dtype=computed,
                                         kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend)
        except ValueError as e:
            return f"vLLM finds no attention backend for the {name}'s {'MLA' if use_mla else 'attention'} layer: {e}", picked
        if not picked[name].supports_dtype(computed):
            return (f"the {name}'s attention backend {picked[name].get_name()} does not take {computed} (it takes "
                    f"{', '.join(str(d) for d in picked[name].supported_dtypes)})"), picked
    found = {name: backend.get_name() for name, backend in picked.items()}
    try:
        found["block_size"] = shared_block_size(dict.fromkeys(picked.values()))
    except ValueError as e:
        return (f"the target's attention ({found['target']}) and the {drafter_layer} drafter's ({found['drafter']}) "
                f"share no KV cache block size: {str(e).rstrip('.')}"), found
    return None, found


def other_settings(settings):
    """The settings one change away from `settings` (drafter_layer, dtype, attention_backend), as
    (how to say the change, the changed settings)."""
    out = []
    for layer in DRAFTER_LAYERS:
        if layer != settings["drafter_layer"]:
            out.append((f"drafter.layer: {layer}", settings | {"drafter_layer": layer}))
    for dtype in ("bfloat16", "float32"):
        if dtype != settings["dtype"]:
            out.append((f"vllm.dtype: {dtype}", settings | {"dtype": dtype}))
    if settings["attention_backend"]:
        out.append(("vllm.attention_backend: null (vLLM's choice)", settings | {"attention_backend": None}))
    return out


def check_engine_start(target_dir, out_path, *, dtype, kv_cache_dtype, attention_backend, drafter_layer,
                       drafter_head_dim=None):
    """The engine_start_check stage: one InputError line with the reason and what would start (the
    drafter layer, the dtype or the attention backend changed), or out_path {"ok": true} (the
    backends picked are in the log)."""
    text_config = target_config(target_dir)
    settings = {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "attention_backend": attention_backend,
                "drafter_layer": drafter_layer or default_layer(text_config),
                "drafter_head_dim": drafter_head_dim or target_geometry(text_config)["head_dim"]}
    problem, found = engine_start_problem(text_config, **settings)
    log.info("vLLM would pick %s for %s", found, settings)
    if problem:
        fixes = [change for change, other in other_settings(settings) if engine_start_problem(text_config, **other)[0] is None]
        fix = f"set {' or '.join(fixes)}" if fixes else "no single change of drafter.layer, vllm.dtype or vllm.attention_backend starts it"
        raise InputError(f"engine_start_check: vLLM would not start the drafter engines on {target_dir}: {problem}; {fix}")
    write_json(out_path, {"ok": True})
