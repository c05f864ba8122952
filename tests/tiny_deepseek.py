"""A tiny, randomly initialised DeepSeek-V3 target (MLA attention + MoE), built locally.

It stands in for Kimi-K2.5's architecture in tests of the vLLM hidden-state backend. The
geometry is the smallest that vLLM's CPU build runs (docs/PITFALLS.md, "vLLM on CPU"): MLA with kv_lora_rank 512
and qk_rope_head_dim 64, `topk_method: "noaux_tc"` routing with sigmoid scores (as Kimi-K2.5),
8 layers so that the default aux layers (2, 4, 5) are distinct, the first layer dense and the
others MoE with a shared expert. No tokenizer: vLLM runs it with skip_tokenizer_init and
prompts given as token ids.

Random init is made less degenerate than transformers' default: the router weights and the
score-correction bias get a larger spread, so that top-k expert choices are not decided by
near-ties (HF and vLLM compute the router in different orders; a near-tie would flip an expert
and make the comparison meaningless), and the weights are large enough for the residual
stream to change visibly from layer to layer.
"""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

GEOMETRY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,           # the dense layers' MLP
    moe_intermediate_size=64,        # each expert's MLP
    num_hidden_layers=8,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=64,                  # Kimi-K2.5 and DeepSeek-V3 compress q too
    kv_lora_rank=512,                # what vLLM's CPU MLA needs
    qk_rope_head_dim=64,             # ditto
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,                       # as Kimi-K2.5
    topk_group=1,
    first_k_dense_replace=1,         # layer 0 dense, layers 1..7 MoE
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_mtp_layers=0,                # no MTP weights to skip
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=None,
)
# Read by vLLM (getattr with other defaults), not fields of transformers' config class.
VLLM_KEYS = dict(topk_method="noaux_tc", scoring_func="sigmoid")


def build_tiny_deepseek(out_dir, *, seed=0, **overrides):
    """Write the tiny DeepseekV3ForCausalLM (config.json, safetensors) to `out_dir`; return its config."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**GEOMETRY, **overrides})
    for key, value in VLLM_KEYS.items():
        setattr(config, key, value)
    config.architectures = ["DeepseekV3ForCausalLM"]
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the router: distinct expert scores per token
                param.normal_(0.0, 0.5)
            elif param.dim() >= 2:  # every projection and the embeddings: a stream that changes
                param.normal_(0.0, 0.08)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # exercised, as in a trained noaux_tc model
                buf.uniform_(-0.1, 0.1)
    model.save_pretrained(out_dir)
    return config
