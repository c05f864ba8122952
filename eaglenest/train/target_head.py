"""The target's head as training uses it: its final norm and lm_head give the distribution the
drafter learns, and its embed_tokens is the drafter's (frozen)."""

import torch

from eaglenest.data.target import read_target_tensors, target_config, target_ties_embeddings
from eaglenest.drafter.model import RMSNorm


class TargetHead:
    """The target's embed_tokens, final norm and lm_head (float32), read from its checkpoint.

    As transformers loads it: its own lm_head.weight when the checkpoint has one, else embed_tokens
    when the config ties them (in the text model's config or a multimodal wrapper's)."""

    def __init__(self, target_dir, device="cpu"):
        text_config = target_config(target_dir)
        names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
        tensors = read_target_tensors(target_dir, names)
        self.embed_tokens = tensors["model.embed_tokens.weight"].float().to(device)  # [V, H]
        if "lm_head.weight" in tensors:
            self.lm_head = tensors["lm_head.weight"].float().to(device)  # [V, H]
        elif target_ties_embeddings(target_dir):
            self.lm_head = self.embed_tokens
        else:
            raise ValueError(f"{target_dir} has no lm_head.weight and untied embeddings")
        hidden_size = self.embed_tokens.shape[1]
        self.norm = RMSNorm(hidden_size, text_config.get("rms_norm_eps", 1e-6)).to(device)
        self.norm.weight.data = tensors["model.norm.weight"].float().to(device)

    @torch.no_grad()
    def distribution(self, final_hidden, t2d, chunk_tokens=4096):
        """final_hidden [B, T, H] (pre-norm) -> (probs over the draft vocab [B, T, N],
        in_vocab [B, T]: the target's argmax over the whole vocab is a draft token).
        Chunked over tokens so [tokens, V] logits never exist at once."""
        B, T, _ = final_hidden.shape
        probs, in_vocab = [], []
        with torch.autocast(final_hidden.device.type, enabled=False):  # argmax ties: stay fp32
            for x in final_hidden.flatten(0, 1).split(chunk_tokens):
                logits = self.norm(x) @ self.lm_head.T  # [n, V]
                in_vocab.append(t2d[logits.argmax(-1)])
                probs.append(logits[:, t2d].softmax(-1))
        return torch.cat(probs).view(B, T, -1), torch.cat(in_vocab).view(B, T)
