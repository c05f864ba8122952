"""The target's head as training uses it: its final norm and lm_head give the distribution the
drafter learns, and its embed_tokens is the drafter's (frozen, shared: eaglenest.train.init_drafter).

Everything stays in the dtype the target stores it in (bf16 for Kimi-K2.5: 2 × 2.3 GB; a float32
copy would double that, per copy), on the training device; only one chunk of tokens' logits
exists at a time."""

import torch

from eaglenest.data.target import read_target_tensors, target_config, target_ties_embeddings
from eaglenest.drafter.model import RMSNorm


class TargetHead:
    """The target's embed_tokens, final norm and lm_head, in their stored dtype, read from its checkpoint.

    As transformers loads it: its own lm_head.weight when the checkpoint has one, else embed_tokens
    when the config ties them (in the text model's config or a multimodal wrapper's). The norm and
    lm_head run in lm_head's dtype (the training dtype: the target's own), as the target does."""

    def __init__(self, target_dir, device="cpu"):
        text_config = target_config(target_dir)
        names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
        tensors = read_target_tensors(target_dir, names)
        self.embed_tokens = tensors["model.embed_tokens.weight"].to(device)  # [V, H]
        if "lm_head.weight" in tensors:
            self.lm_head = tensors["lm_head.weight"].to(device)  # [V, H]
        elif target_ties_embeddings(target_dir):
            self.lm_head = self.embed_tokens
        else:
            raise ValueError(f"{target_dir} has no lm_head.weight and untied embeddings")
        self.dtype = self.lm_head.dtype
        hidden_size = self.embed_tokens.shape[1]
        self.norm = RMSNorm(hidden_size, text_config.get("rms_norm_eps", 1e-6))
        self.norm.weight = torch.nn.Parameter(tensors["model.norm.weight"].to(device, self.dtype), requires_grad=False)

    @torch.no_grad()
    def distribution(self, final_hidden, t2d, temperature=1.0, chunk_tokens=4096):
        """final_hidden [B, T, H] (pre-norm, any dtype) -> (float32 probs over the draft vocab [B, T, N]
        at `temperature`: the softmax of its logits / temperature, in_vocab [B, T]: the target's argmax
        over the whole vocab is a draft token).

        Chunked over tokens so [tokens, V] logits never exist at once; a chunk's logits are in the
        training dtype, only its draft-vocab columns go float32 for the softmax. Autocast is off:
        the dtype is the target's, whatever the drafter trains under. Ties (two tokens of equal
        bf16 logit) go to the lowest id, as torch.argmax and vLLM's greedy sampling pick: in_vocab
        is False when the lowest maximal id is not a draft token, even if a higher tied one is
        (docs/TRAINING.md, "The drafter")."""
        B, T, _ = final_hidden.shape
        probs, in_vocab = [], []
        with torch.autocast(final_hidden.device.type, enabled=False):
            for x in final_hidden.flatten(0, 1).split(chunk_tokens):
                logits = self.norm(x.to(self.dtype)) @ self.lm_head.T  # [n, V], training dtype
                in_vocab.append(t2d[logits.argmax(-1)])
                probs.append((logits[:, t2d].float() / temperature).softmax(-1))
        return torch.cat(probs).view(B, T, -1), torch.cat(in_vocab).view(B, T)

    @torch.no_grad()
    def argmax(self, final_hidden, chunk_tokens=4096):
        """final_hidden [..., H] (pre-norm, any dtype) -> [...] the target's greedy token after each
        position, over the whole vocab (ties to the lowest id, as in distribution()): the drafts of
        an oracle drafter, the ceiling of eaglenest.evaluate.expected."""
        with torch.autocast(final_hidden.device.type, enabled=False):
            ids = [(self.norm(x.to(self.dtype)) @ self.lm_head.T).argmax(-1)
                   for x in final_hidden.flatten(0, -2).split(chunk_tokens)]
        return torch.cat(ids).view(final_hidden.shape[:-1])

    @torch.no_grad()
    def logits(self, final_hidden, tokens):
        """final_hidden [H] (pre-norm, any dtype), tokens [n] target ids -> ([n] float64 logits, [n]
        sum_i |w_i x_i| of each): the target's logits of `tokens` as the token after that position,
        computed in float64 (the norm, and lm_head's rows of `tokens` alone) so that their gap is read
        far below any engine dtype's rounding, float32's included, and each dot product's absolute
        sum, which bounds what rounding its terms moves it by (eaglenest.evaluate.greedy_identity)."""
        x = final_hidden.double()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm.eps) * self.norm.weight.double()
        w = self.lm_head[tokens].double()
        return w @ x, w.abs() @ x.abs()

    @torch.no_grad()
    def token_probs(self, final_hidden, tokens, temperature, chunk_tokens=1024):
        """final_hidden [T, H] (pre-norm, any dtype), tokens [K, T] target ids -> [K, T] float32: the
        target's probability of tokens[k, s] as the token after position s at `temperature` (the
        softmax of logits / temperature over the whole vocab, as vLLM samples without top-k or
        top-p). Chunked over positions: Kimi-K2.5's [1024, 163840] float32 logits are 0.7 GB."""
        out = []
        with torch.autocast(final_hidden.device.type, enabled=False):
            for x, ids in zip(final_hidden.split(chunk_tokens), tokens.split(chunk_tokens, dim=1)):
                logits = (self.norm(x.to(self.dtype)) @ self.lm_head.T).float() / temperature  # [n, V]
                inside = (ids.T >= 0) & (ids.T < logits.shape[1])  # a misread d2t may point past the vocab: 0
                probs = logits.log_softmax(-1).gather(1, ids.T.clamp(0, logits.shape[1] - 1)).exp() * inside
                out.append(probs.T)  # [K, n]
        return torch.cat(out, dim=1)
