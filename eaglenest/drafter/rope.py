"""RoPE as vLLM's `get_rope` computes it for each drafter layer: for gqa (the Llama layer) plain,
YaRN (YaRNScalingRotaryEmbedding) or Llama 3's, rotate-half; for mla (DeepseekV2MLAAttention) plain
or DeepSeek's YaRN (DeepseekScalingRotaryEmbedding), interleaved, with its softmax-scale correction."""

import math

import torch


# What the drafter computes, with the keys vLLM's get_rope reads for each (the required ones
# first); any other type is refused, never dropped.
ROPE_KEYS = {
    "default": ((), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
}


def checked_rope_scaling(scaling, max_position_embeddings):
    """`scaling` (HF/vLLM shape, `rope_type` or the older `type`, no rope_theta) in one form: None
    for plain RoPE, else {"rope_type": "yarn" | "llama3", the keys given}. Raises ValueError naming the
    rope_type or keys the drafter does not compute, rather than train or serve something else."""
    if not scaling:
        return None
    params = dict(scaling)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in ROPE_KEYS:
        raise ValueError(f"rope_type {rope_type!r} is not implemented by the drafter (only {', '.join(ROPE_KEYS)})")
    required, optional = ROPE_KEYS[rope_type]
    if unknown := sorted(set(params) - set(required) - set(optional)):
        raise ValueError(f"rope_type {rope_type!r}: keys not implemented by the drafter: {unknown}")
    if rope_type == "default":
        return None
    if missing := [key for key in required if key not in params]:
        raise ValueError(f"rope_type {rope_type!r} needs {missing}")
    if rope_type == "llama3":
        return {"rope_type": "llama3", **params}
    covered = params["original_max_position_embeddings"] * params["factor"]
    if max_position_embeddings > covered:  # vLLM's YaRN cos/sin cache has `covered` positions
        raise ValueError(
            f"max_position_embeddings {max_position_embeddings} is beyond the {covered:g} positions YaRN covers "
            "(original_max_position_embeddings × factor)"
        )
    return {"rope_type": "yarn", **params}


def checked_mla_rope(scaling):
    """Refuse a checked_rope_scaling() result the mla layer would not compute as vLLM does: its
    attention turns every rope_type but default into DeepSeek's YaRN (deepseek_v2.py:1115-1120),
    which always truncates the ramp (common.py yarn_find_correction_range)."""
    if scaling is None:
        return
    if scaling["rope_type"] != "yarn":
        raise ValueError(f"layer mla: rope_type {scaling['rope_type']!r} (vLLM's MLA computes plain RoPE or DeepSeek's YaRN)")
    if not scaling.get("truncate", True):
        raise ValueError("layer mla: YaRN truncate false (vLLM's DeepSeek YaRN always truncates)")


def mla_rope_scaling(scaling):
    """The YaRN of vLLM's DeepseekScalingRotaryEmbedding in rope_frequencies' terms: its cos/sin
    magnitude mscale(factor, mscale) / mscale(factor, mscale_all_dim) (defaults 1 and 0, whatever
    attention_factor says) given as attention_factor, the ramp truncated."""
    if scaling is None:
        return None
    factor = scaling["factor"]
    magnitude = yarn_mscale(factor, float(scaling.get("mscale", 1))) / yarn_mscale(factor, float(scaling.get("mscale_all_dim", 0)))
    return {**scaling, "attention_factor": magnitude, "truncate": True}


def mla_softmax_factor(scaling):
    """What vLLM multiplies the MLA softmax scale qk_head_dim^-0.5 by (deepseek_v2.py:1129-1136):
    mscale(factor, mscale_all_dim)² under DeepSeek YaRN; 1 for plain RoPE and for
    `deepseek_llama_scaling` (attention_factor 1.0)."""
    if scaling is None or scaling.get("attention_factor") == 1.0:
        return 1.0
    return yarn_mscale(scaling["factor"], float(scaling.get("mscale_all_dim", False))) ** 2


def yarn_mscale(factor, mscale=1.0):
    """YaRN's magnitude correction for a context `factor` times longer (vLLM's yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_correction_dim(rotations, dim, theta, original_max_position):
    """The dim whose wavelength makes `rotations` turns over the original context."""
    return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def rope_frequencies(dim, theta, scaling, device):
    """(inv_freq [dim/2], magnitude of cos and sin), computed as vLLM's RotaryEmbedding (plain),
    Llama3RotaryEmbedding and YaRNScalingRotaryEmbedding do, in the same float32 steps: YaRN keeps the original
    frequencies of the fast dims, divides those of the slow dims by `factor`, blends between
    them over a linear ramp of dims, and scales cos and sin by an mscale."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    if scaling["rope_type"] == "llama3":
        return llama3_frequencies(1.0 / pos_freqs, scaling), 1.0
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low = yarn_correction_dim(scaling.get("beta_fast", 32), dim, theta, original)
    high = yarn_correction_dim(scaling.get("beta_slow", 1), dim, theta, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as vLLM: no division by zero
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: the interpolated one
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    if scaling.get("attention_factor") is not None:
        mscale = float(scaling["attention_factor"])
    elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    else:
        mscale = yarn_mscale(factor)
    return inv_freq, mscale


def llama3_frequencies(inv_freq, scaling):
    """Llama 3's long-context frequencies (vLLM's Llama3RotaryEmbedding): wavelengths shorter
    than original/high_freq_factor kept, longer than original/low_freq_factor divided by
    `factor`, a linear blend between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low) if low != high else 0
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen < original / high, inv_freq,
                       torch.where(wavelen > original / low, inv_freq / factor, blended))


def rope_cos_sin(positions, dim, theta, scaling=None):
    """cos, sin [..., T, dim/2] at `positions` [..., T]: the rows of vLLM's cos_sin_cache."""
    inv_freq, mscale = rope_frequencies(dim, theta, scaling, positions.device)
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    return freqs.cos() * mscale, freqs.sin() * mscale


def apply_rope(x, positions, theta, scaling=None, interleaved=False):
    """Rotate-half (neox) RoPE, or with `interleaved` GPT-J's (vLLM's is_neox_style=False: pairs of
    adjacent dims). x [B, T, heads, D], positions [B, T] or [T] -> [B, T, heads, D]."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, scaling)
    if interleaved:
        cos, sin = cos.repeat_interleave(2, -1)[..., None, :], sin.repeat_interleave(2, -1)[..., None, :]
        x1, x2 = x.float()[..., ::2], x.float()[..., 1::2]
        rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
        return (x.float() * cos + rotated * sin).to(x.dtype)
    cos, sin = torch.cat([cos, cos], dim=-1)[..., None, :], torch.cat([sin, sin], dim=-1)[..., None, :]  # [..., T, 1, D]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)
