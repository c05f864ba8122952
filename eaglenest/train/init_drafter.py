"""A new drafter: its geometry (from the target, an init_from checkpoint, explicit `drafter:`
settings) and its first weights."""

import logging
import math

import torch

from eaglenest.data.target import rope_settings, target_config
from eaglenest.drafter.export import mla_export_problem
from eaglenest.drafter.load import read_checkpoint
from eaglenest.drafter.model import MLA_FIELDS, Drafter, DrafterConfig
from eaglenest.states.convention import FINAL_STATE_CONVENTION, resolve_aux_layer_ids
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)

# The geometry for targets whose attention a Llama layer cannot copy (MLA, or no usable head_dim),
# sized for the DeepSeek-V3 class (docs/TRAINING.md "Drafter geometry" says why each).
HEAD_DIM = 128  # served by every vLLM attention backend (FlashInfer: 64, 128, 256, 512 only)
KV_HEADS = 8  # one KV head per GPU at tensor parallel 8 (capped to divide the heads)
INTERMEDIATE_SIZE = 12288  # the public Kimi-K2.5 EAGLE-3 drafter's
ROPE_THETA = 1e6  # plain RoPE; its slowest wavelength spans far more than the context
# The norm flags of every new drafter, unless config drafter: sets one (docs/RECIPE.md)
NORM_DEFAULTS = {"norm_before_residual": False, "norm_before_fc": False, "norm_output": False}


def target_geometry(tc):
    """The drafter geometry a target's text config implies. A Llama-style target (no MLA, a
    head_dim given or hidden/heads an integer) lends its own attention, MLP and RoPE, scaling
    included. Otherwise the drafter gets a Llama layer of its own: the target's heads of HEAD_DIM,
    plain RoPE over the target's positions (the target's rope, e.g. MLA's YaRN on a 64-dim part,
    describes no Llama head)."""
    hidden_size, heads = tc["hidden_size"], tc["num_attention_heads"]
    shape = {
        "num_attention_heads": heads,
        "rms_norm_eps": tc.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": tc.get("max_position_embeddings", 32768),
        **NORM_DEFAULTS,
    }
    if tc.get("kv_lora_rank") is None and (tc.get("head_dim") or hidden_size % heads == 0):
        rope_theta, rope_scaling = rope_settings(tc)
        return shape | {
            "intermediate_size": tc["intermediate_size"],
            "num_key_value_heads": tc.get("num_key_value_heads") or heads,
            "head_dim": tc.get("head_dim") or hidden_size // heads,
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
        }
    log.info("the target's attention (MLA, or no usable head_dim) is no Llama head: default drafter geometry "
             "(docs/TRAINING.md \"Drafter geometry\"), plain RoPE theta %g; the target's rope %s is not carried over",
             ROPE_THETA, rope_settings(tc))
    return shape | {
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_key_value_heads": math.gcd(heads, KV_HEADS),
        "head_dim": HEAD_DIM,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
    }


def mla_geometry(tc):
    """The mla drafter geometry a target's text config implies: the target's MLA (ranks and head
    dims; none on a target without MLA, to be set in config `drafter:`) and its rope, YaRN
    included (Kimi-K2.5's `rope_scaling` with mscale and mscale_all_dim), and as intermediate_size
    the target's `intermediate_size`: its dense layers' MLP (first_k_dense_replace), which the
    drafter's dense MLP is, not an expert's (moe_intermediate_size)."""
    rope_theta, rope_scaling = rope_settings(tc)
    return {
        "num_attention_heads": tc["num_attention_heads"],
        "rms_norm_eps": tc.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": tc.get("max_position_embeddings", 32768),
        **NORM_DEFAULTS,
        "layer": "mla",
        "intermediate_size": tc["intermediate_size"],
        **{name: tc.get(name) for name in MLA_FIELDS},
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
    }


def default_layer(tc):
    """The drafter layer for a target's text config when none is set: mla on an MLA target (the
    layer vLLM serves beside the target's own MLA on every backend: docs/TRAINING.md "The mla
    layer", measured), else gqa."""
    return "mla" if tc.get("kv_lora_rank") else "gqa"


def make_drafter_config(target_dir, manifest, d2t, t2d, init_config=None, geometry=None):
    """Drafter geometry: the target's (target_geometry), replaced by an init_from checkpoint's
    (its weights must fit, and its q/k were trained with its own RoPE), replaced by the non-null
    `geometry` values (config `drafter:`). hidden_size is the target's (the drafter embeds with
    the target's embed_tokens). The layer is `geometry`'s, else the init_from drafter's, else the
    target's kind (default_layer). An mla layer starts from mla_geometry, its head_dim and KV heads
    follow its MLA (as DeepseekV2Config derives them), and it has no input_norm: norm_before_fc is
    a gqa setting (vLLM's Eagle3DeepseekV2ForCausalLM would not read it)."""
    tc = target_config(target_dir)
    hidden_size = tc["hidden_size"]
    if manifest["hidden_size"] != hidden_size or manifest.get("final_state") != FINAL_STATE_CONVENTION:
        raise ValueError("shards do not match the target: hidden size or final state convention")
    geometry = {key: value for key, value in (geometry or {}).items() if value is not None}
    layer = geometry.get("layer") or (init_config.layer if init_config is not None else default_layer(tc))
    if layer == "mla" and geometry.pop("norm_before_fc", False):
        log.info("drafter.norm_before_fc applies to the gqa layer only: the mla drafter has no input_norm")
    shape = mla_geometry(tc) if layer == "mla" else target_geometry(tc)
    if init_config is not None:
        if (init_config.hidden_size, init_config.target_vocab_size) != (hidden_size, len(t2d)):
            raise ValueError("init_from drafter was made for a target of another size")
        if init_config.aux_layer_ids is not None and list(init_config.aux_layer_ids) != list(manifest["aux_layer_ids"]):
            raise InputError(
                f"init_from drafter was trained on aux layers {init_config.aux_layer_ids}, the hidden states "
                f"hold {manifest['aux_layer_ids']}: set hidden_states.aux_layer_ids to {init_config.aux_layer_ids}"
            )
        shape.update({key: getattr(init_config, key) for key in shape})
    shape.update(geometry)
    if layer == "mla":
        shape.update(head_dim=shape["qk_rope_head_dim"], num_key_value_heads=shape["num_attention_heads"])
    log.info("drafter geometry: %s", shape)
    try:
        config = DrafterConfig(
            target_vocab_size=len(t2d),
            draft_vocab_size=len(d2t),
            hidden_size=hidden_size,
            target_hidden_size=hidden_size,
            aux_layer_ids=list(manifest["aux_layer_ids"]),
            **shape,
        )
    except ValueError as e:  # the RoPE: a type the drafter does not compute, or too few positions; an mla field missing
        raise InputError(f"drafter: {e} (config drafter.rope_scaling, rope_theta, max_position_embeddings; "
                         "rope_scaling {rope_type: default} is plain RoPE; drafter.layer and its MLA fields)") from e
    if config.layer == "mla" and (problem := mla_export_problem(config)):
        raise InputError(f"drafter: {problem} (config drafter.q_lora_rank, norm_before_fc)")
    return config


def planned_drafter_config(target_dir, *, aux_layer_ids, draft_vocab_size, init_from=None, geometry=None):
    """The DrafterConfig training will build (make_drafter_config), before any hidden state or
    vocab map exists: what the plan sizes, and a geometry the drafter cannot compute refused
    before hours of extraction rather than after. aux_layer_ids: config hidden_states'."""
    tc = target_config(target_dir)
    vocab = tc["vocab_size"]
    manifest = {"hidden_size": tc["hidden_size"], "final_state": FINAL_STATE_CONVENTION,
                "aux_layer_ids": resolve_aux_layer_ids(aux_layer_ids, tc["num_hidden_layers"])}
    init_config = read_checkpoint(init_from)[0] if init_from is not None else None
    return make_drafter_config(target_dir, manifest, range(min(draft_vocab_size, vocab)), range(vocab), init_config,
                               geometry)


def init_from_checkpoint(drafter, state, target_lm_head):
    """Load a pre-trained drafter's weights (`state`, speculators names) into `drafter`.

    The draft vocabs may differ: our lm_head row for target id x is their row for x when x is
    in both vocabs, else the target lm_head row of x. embed_tokens stays the target's.
    """
    own = drafter.state_dict()
    for name in own:
        if name in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
            continue
        if name not in state or state[name].shape != own[name].shape:
            raise ValueError(f"init_from: {name} missing or of another shape")
        own[name].copy_(state[name])
    V = drafter.config.target_vocab_size
    our_ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))
    their_ids = torch.arange(len(state["d2t"])) + state["d2t"]
    their_row = torch.full((V,), -1, dtype=torch.int64)
    their_row[their_ids] = torch.arange(len(their_ids))
    rows = their_row[our_ids]
    lm_head = own["lm_head.weight"]  # the draft rows, in the drafter's dtype: never the whole target head
    lm_head.copy_(target_lm_head[our_ids.to(target_lm_head.device)])
    lm_head[rows >= 0] = state["lm_head.weight"][rows[rows >= 0]].to(lm_head.dtype)
    return int((rows >= 0).sum())


def new_drafter(target_dir, manifest, d2t, t2d, head, *, seed, init_from=None, geometry=None, init_std=None):
    """The drafter training starts from, on the CPU but for its embedding: weights drawn from
    `seed` (fc, attention and MLP from N(0, init_std) when it is set, as transformers'
    _init_weights draws a Llama's, else PyTorch's default uniform), the vocab maps, lm_head rows from an init_from checkpoint (see init_from_checkpoint)
    or else the target lm_head's rows of the draft vocab, and as embed_tokens the head's own
    tensor (TargetHead: on its device, in the target's dtype), frozen and shared, never copied:
    the optimizer, built over the parameters that require grad, never sees it."""
    init_config = init_state = None
    if init_from is not None:
        init_config, init_state = read_checkpoint(init_from)
    config = make_drafter_config(target_dir, manifest, d2t, t2d, init_config, geometry)
    torch.manual_seed(seed)
    drafter = Drafter(config)
    if init_std is not None:
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear) and module is not drafter.lm_head:  # lm_head: the target's rows
                torch.nn.init.normal_(module.weight, std=init_std)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    drafter.embed_tokens.weight = torch.nn.Parameter(head.embed_tokens, requires_grad=False)
    if init_state is not None:
        shared = init_from_checkpoint(drafter, init_state, head.lm_head)
        log.info("init_from %s: %d/%d lm_head rows reused", init_from, shared, len(d2t))
    else:
        draft_ids = drafter.draft_to_target(torch.arange(len(d2t)))
        drafter.lm_head.weight.data.copy_(head.lm_head[draft_ids.to(head.lm_head.device)])
    return drafter
