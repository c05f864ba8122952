"""A tiny, randomly initialised DeepSeek-V3 target (MLA attention + MoE), built locally.

It stands in for Kimi-K2.5's architecture in tests of the vLLM hidden-state backend. Its config is
the Kimi-shaped demo target's (eaglenest.demo.kimi: the smallest geometry vLLM's CPU build runs,
`noaux_tc` routing as Kimi-K2.5, 8 layers), without a tokenizer: vLLM runs it with
skip_tokenizer_init and prompts given as token ids.

Random init is made less degenerate than transformers' default: the router weights and the
score-correction bias get a larger spread, so that top-k expert choices are not decided by
near-ties (HF and vLLM compute the router in different orders; a near-tie would flip an expert
and make the comparison meaningless), and the weights are large enough for the residual
stream to change visibly from layer to layer.
"""

import torch
from transformers import DeepseekV3ForCausalLM

from eaglenest.demo.kimi import deepseek_config


def build_tiny_deepseek(out_dir, *, seed=0, **overrides):
    """Write the tiny DeepseekV3ForCausalLM (config.json, safetensors) to `out_dir`; return its config."""
    torch.manual_seed(seed)
    config = deepseek_config(**overrides)
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
