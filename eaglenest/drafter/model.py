"""The EAGLE-3 drafter: one decoder layer fed by the target, as vLLM runs it.

Mirrors vLLM's `Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py):

    h_0      = fc(cat[aux states of the target])                       [*, 3Ht] -> [*, H]
               fc(input_norm(cat[...]))  (norm_before_fc=True: one RMSNorm over all 3Ht)
    one step (token x, hidden h, rotary position p):
      e        = input_layernorm(embed_tokens(x))
      residual = h              (norm_before_residual=False: EAGLE/SGLang)
                 hidden_norm(h) (norm_before_residual=True)
      a        = self_attn(cat[e, hidden_norm(h)], p)                  q/k/v take 2H
      r        = residual + a
      out      = r + mlp(post_attention_layernorm(r))                  the PRE-norm output
      logits   = lm_head(norm(out))                                    [*, N] draft vocab
    the next step gets h = out: vLLM's LlamaModel returns (norm(out), out) and the proposer
    feeds the second one back (`aux_output = hidden_prenorm`), or h = norm(out) (norm_output=True).
The three norm flags are the "EAGLE 3.1" variants vLLM reads from both export formats.

Two kinds of layer (DrafterConfig.layer), the same around the attention:
  "gqa": Llama attention, q/k/v/o_proj (vLLM's `Eagle3LlamaForCausalLM`);
  "mla": DeepSeek's multi-head latent attention (MLAttention), the layer of vLLM's
         `Eagle3DeepseekV2ForCausalLM` (vllm/model_executor/models/deepseek_eagle3.py), whose MLP
         is a dense one like the Llama layer's.

Parameter and buffer names are the weight names vLLM loads, so export is a state_dict save.
RoPE (eaglenest/drafter/rope.py) is computed as vLLM computes it for each layer (`get_rope`): for
gqa plain, YaRN or Llama 3's, rotate-half; for mla plain or DeepSeek's YaRN, on the rope part of q
and k only, interleaved.
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eaglenest.drafter.rope import apply_rope, checked_mla_rope, checked_rope_scaling, mla_rope_scaling, mla_softmax_factor


@dataclass
class DrafterConfig:
    target_vocab_size: int  # V
    draft_vocab_size: int  # N
    hidden_size: int  # H (= the target's: embed_tokens comes from the target)
    target_hidden_size: int  # Ht, width of each aux state
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    aux_layer_ids: list  # the 3 target layer ids, vLLM convention (residual entering layer k)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None: plain RoPE; else {"rope_type": "yarn" | "llama3", ...} (checked_rope_scaling)
    max_position_embeddings: int = 32768
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # an RMSNorm (input_norm) over the 3 aux states fc reads
    norm_output: bool = False  # the next step reads the normed output, not the pre-norm one
    layer: str = "gqa"  # "gqa": Llama attention; "mla": DeepSeek's latent attention (module docstring)
    # mla only (None for gqa): DeepseekV2MLAAttention's geometry. head_dim is qk_rope_head_dim and
    # num_key_value_heads num_attention_heads there, as transformers' DeepseekV2Config derives them.
    q_lora_rank: int | None = None  # None: q_proj straight from 2H, else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int | None = None  # width of the compressed kv (kv_a_proj_with_mqa's first part)
    qk_nope_head_dim: int | None = None  # per head: the part of q and k without rope
    qk_rope_head_dim: int | None = None  # per head: the part with rope (k's shared by all heads)
    v_head_dim: int | None = None

    def __post_init__(self):
        self.rope_scaling = checked_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        mla = {name: getattr(self, name) for name in MLA_FIELDS}
        if self.layer == "gqa":
            if set_fields := [name for name, value in mla.items() if value is not None]:
                raise ValueError(f"layer gqa has no {set_fields}")
        elif self.layer == "mla":
            if missing := [name for name, value in mla.items() if value is None and name != "q_lora_rank"]:
                raise ValueError(f"layer mla needs {missing}")
            if (self.head_dim, self.num_key_value_heads) != (self.qk_rope_head_dim, self.num_attention_heads):
                raise ValueError("layer mla: head_dim must be qk_rope_head_dim and num_key_value_heads "
                                 "num_attention_heads (as DeepseekV2Config derives them)")
            checked_mla_rope(self.rope_scaling)
        else:
            raise ValueError(f"layer {self.layer!r} is neither gqa nor mla")

    def to_dict(self):
        """The fields; a gqa config without the mla ones (its trained_config.json as before mla)."""
        fields = asdict(self)
        if self.layer == "gqa":
            for name in ("layer", *MLA_FIELDS):
                del fields[name]
        return fields


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (as HF Llama and vLLM)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def repeat_kv(x, num_heads):
    """GQA: [B, T, kv_heads, D] -> [B, T, num_heads, D], query head h reads kv head h // group."""
    return x.repeat_interleave(num_heads // x.shape[2], dim=2)


def shift_left(x, n, fill):
    """x[:, t + n] at index t along dim 1, `fill` past the end. [B, T, ...] -> [B, T, ...]."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


# Queries per block of ttt_attention: one block's scores are [B, heads, ATTENTION_BLOCK, T + k].
ATTENTION_BLOCK = 512


def ttt_attention(q, keys, values):
    """Attention of one TTT step, for every anchor t at once.

    q [B, T, nh, D]; keys/values: lists of [B, T, nkv, D] / [B, T, nkv, Dv] (after RoPE), entry 0 from step 0,
    entry s from step s. Query t of step k attends the step-0 keys at anchors 0..t (causal)
    and the keys of steps 1..k at its own anchor t (the diagonal): the drafter's KV cache in
    vLLM while it drafts from anchor t. One softmax over both parts. Right padding only adds
    anchors after t, which the causal part never sees. Returns [B, T, nh, Dv].

    Computed ATTENTION_BLOCK queries at a time, each block checkpointed when grad is on: backward
    recomputes a block's scores instead of keeping them, so a step retains q, keys, values and
    its output, O(T), never the O(T²) scores.
    """
    T = q.shape[1]
    blocks = []
    for start in range(0, T, ATTENTION_BLOCK):
        end = min(start + ATTENTION_BLOCK, T)
        # Slices (views) taken now: a block rerun in backward sees these steps' keys only.
        block = (q[:, start:end], (keys[0][:, :end], *(k[:, start:end] for k in keys[1:])),
                 (values[0][:, :end], *(v[:, start:end] for v in values[1:])), start)
        if torch.is_grad_enabled():
            blocks.append(checkpoint(ttt_attention_block, *block, use_reentrant=False))
        else:
            blocks.append(ttt_attention_block(*block))
    return torch.cat(blocks, dim=1)


def ttt_attention_block(q, keys, values, start):
    """ttt_attention of the n queries q [B, n, nh, D] at anchors start..start+n-1 -> [B, n, nh, Dv].
    keys[0], values[0]: step 0's from anchor 0 on, [B, >= start+n, nkv, D] (those past start+n
    unused: causal); keys[s], values[s] for s >= 1: step s's at these n anchors, [B, n, nkv, D].
    Scores are [.., n, start+n+k]. GQA without copying keys: the `group` query heads of one kv
    head are one batch of queries."""
    B, n, nh, D = q.shape
    nkv, end, Dv = keys[0].shape[2], start + n, values[0].shape[-1]
    group = nh // nkv  # query head h reads kv head h // group
    q = q.reshape(B, n, nkv, group, D).permute(0, 2, 3, 1, 4) / math.sqrt(D)  # [B, nkv, group, n, D]
    k0 = keys[0][:, :end].transpose(1, 2)  # [B, nkv, end, D]
    v0 = values[0][:, :end].transpose(1, 2)
    causal = (q.reshape(B, nkv, group * n, D) @ k0.transpose(-1, -2)).view(B, nkv, group, n, end)
    future = torch.arange(end, device=q.device) > torch.arange(start, end, device=q.device)[:, None]  # [n, end]
    causal = causal.masked_fill(future, float("-inf"))
    diagonal = [(q * k.transpose(1, 2)[:, :, None]).sum(-1, keepdim=True) for k in keys[1:]]  # [B, nkv, group, n, 1]
    scores = torch.cat([causal, *diagonal], dim=-1)  # [B, nkv, group, n, end + k]
    probs = scores.float().softmax(-1).to(q.dtype)
    out = (probs[..., :end].reshape(B, nkv, group * n, end) @ v0).view(B, nkv, group, n, Dv)
    for s, v in enumerate(values[1:]):
        out = out + probs[..., end + s, None] * v.transpose(1, 2)[:, :, None]
    return out.permute(0, 3, 1, 2, 4).reshape(B, n, nh, Dv)


def ttt_attend(keys, values, step):
    """The `attend` of TTT step `step`: it stores the step's keys and values at index `step` of
    the lists and attends those of steps 0..step. Storing by index, not appending, lets a
    checkpointed layer run again in backward: the rerun rewrites its own entry with equal values."""

    def attend(q, k, v):
        keys[step], values[step] = k, v
        return ttt_attention(q, keys[: step + 1], values[: step + 1])

    return attend


def cached_attend(cache, start):
    """The `attend` of every step for the anchors from `start` of one chunk, drafting over a KV
    cache as vLLM's drafter does: `cache` ([keys, values], empty at first) holds step 0's of every
    earlier anchor, and step 0 of this chunk extends it; step k attends the cache up to its own
    anchor and steps 1..k's keys at that anchor (ttt_attention's mask, chunk by chunk). Call the
    chunk's steps in order, step 0 first."""
    steps = []  # this chunk's (keys, values), step 0's first

    def attend(q, k, v):
        steps.append((k, v))
        if len(steps) == 1:  # step 0 extends the cache
            cache[:] = [torch.cat([*cache[:1], k], 1), torch.cat([*cache[1:], v], 1)]
        later = steps[1:]
        return ttt_attention_block(q, [cache[0], *(key for key, _ in later)], [cache[1], *(value for _, value in later)],
                                   start)

    return attend


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.rope_theta, self.rope_scaling = c.rope_theta, c.rope_scaling
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, positions, attend):
        """x [B, T, 2H] -> [B, T, H]. `attend(q, k, v)` ([B, T, heads, D] after RoPE) chooses
        which keys each query sees: the TTT mask in training, a KV cache in the tests."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, positions, self.rope_theta, self.rope_scaling)
        k = apply_rope(k, positions, self.rope_theta, self.rope_scaling)
        return self.o_proj(attend(q, k, v).reshape(B, T, -1))


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention as vLLM's DeepseekV2MLAAttention computes it
    (vllm/model_executor/models/deepseek_v2.py:1000, the math of layers/mla.py:163-255), input 2H
    as the Eagle3 layer builds it (deepseek_eagle3.py:82: every projection from the input takes 2H).
    Written out, not absorbed: k and v per head, which the TTT/KV-cache `attend` takes as it is."""

    def __init__(self, c):
        super().__init__()
        self.num_heads, self.kv_lora_rank = c.num_attention_heads, c.kv_lora_rank
        self.nope, self.rope, self.v_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rope_theta, self.rope_scaling = c.rope_theta, mla_rope_scaling(c.rope_scaling)
        self.softmax_factor = mla_softmax_factor(c.rope_scaling)  # on q: attend scales by qk_head_dim^-0.5
        qk_head_dim, heads = self.nope + self.rope, c.num_attention_heads
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(2 * c.hidden_size, heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(2 * c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * c.hidden_size, c.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, heads * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, c.hidden_size, bias=False)

    def forward(self, x, positions, attend):
        """x [B, T, 2H] -> [B, T, H]; `attend` as Attention's, with q, k [B, T, nh, nope + rope]
        and v [B, T, nh, v_head_dim]."""
        B, T, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, T, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).view(B, T, self.num_heads, self.nope + self.v_head_dim)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, positions, self.rope_theta, self.rope_scaling, interleaved=True)
        k_pe = apply_rope(k_pe[:, :, None], positions, self.rope_theta, self.rope_scaling, interleaved=True)  # one for all heads
        q = torch.cat([q_nope, q_pe], dim=-1)
        if self.softmax_factor != 1.0:
            q = q * self.softmax_factor
        k = torch.cat([k_nope, k_pe.expand(B, T, self.num_heads, self.rope)], dim=-1)
        return self.o_proj(attend(q, k, v).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAttention(c) if c.layer == "mla" else Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, hidden, positions, attend):
        """embeds, hidden [B, T, H] -> pre-norm output [B, T, H] (vLLM's layer 0 + residual add)."""
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:  # vLLM `_norm_before_residual`
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:  # vLLM `_norm_after_residual`
            residual = hidden
            hidden = self.hidden_norm(hidden)
        attn = self.self_attn(torch.cat([embeds, hidden], dim=-1), positions, attend)
        residual = residual + attn
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Drafter(nn.Module):
    # Execution switch, not part of the config: True reruns the decoder layer in backward
    # instead of keeping its activations (training with grad on only).
    activation_checkpointing = False

    def __init__(self, config):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.target_vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        if c.norm_before_fc:
            self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)  # 3 aux states
        self.layers = nn.ModuleList([DecoderLayer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # draft id i is target id i + d2t[i]; t2d marks the target ids in the draft vocab
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.target_vocab_size, dtype=torch.bool))

    def draft_to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, aux_hidden_states):
        """The first hidden state: aux [*, 3Ht] -> fc(aux) [*, H], input_norm first when
        norm_before_fc. No cast: under autocast fc casts, and a float32 copy of bf16 states
        would double their memory."""
        if self.config.norm_before_fc:
            aux_hidden_states = self.input_norm(aux_hidden_states)
        return self.fc(aux_hidden_states)

    def step(self, input_ids, hidden, positions, attend):
        """One draft step: input_ids [B, T], hidden [B, T, H] at `positions`
        -> (logits [B, T, N], the output [B, T, H] that the next step reads: pre-norm, or
        normed when norm_output)."""
        embeds = self.embed_tokens(input_ids).to(self.fc.weight.dtype)  # the frozen embedding is in the target's dtype
        if self.activation_checkpointing and torch.is_grad_enabled():
            out = checkpoint(self.layers[0], embeds, hidden, positions, attend, use_reentrant=False)
        else:
            out = self.layers[0](embeds, hidden, positions, attend)
        normed = self.norm(out)
        return self.lm_head(normed), normed if self.config.norm_output else out

    def forward(self, input_ids, aux_hidden_states, num_steps):
        """Training-time test: `num_steps` chained draft steps at every anchor t at once.

        input_ids [B, T] (x), aux_hidden_states [B, T, 3Ht] (a). Step k at anchor t reads token
        x_{t+k+1} (teacher forcing; 0 past the end) at position t+k, the hidden state fc(a_t) for
        k = 0 and the step k-1 output otherwise, and predicts x_{t+k+2}.
        Returns a list of num_steps logits [B, T, N]; entry k, index t = step k at anchor t.
        """
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)
        hidden = self.fuse(aux_hidden_states)  # [B, T, H]
        keys, values = [None] * num_steps, [None] * num_steps  # step s's [B, T, nkv, D] / [.., Dv], after RoPE
        logits = []
        for k in range(num_steps):
            tokens = shift_left(input_ids, k + 1, 0)
            step_logits, hidden = self.step(tokens, hidden, positions + k, ttt_attend(keys, values, k))
            logits.append(step_logits)
        return logits
