"""A tiny target packaged as Kimi-K2.5 ships (docs/KIMI.md): the
random tiny DeepSeek-V3 of tests/tiny_deepseek.py with YaRN rope scaling, packaged by the Kimi-shaped
demo target's own code (eaglenest.demo.kimi.package_as_kimi): a `kimi_k25` wrapper config, the
`language_model.` prefix, a complete tiny vision tower and projector, two safetensors files.
`build_plain_twin` writes the same text model as a plain checkpoint, so that tests can hold every
reading of the wrapper against the plain model.
"""

import json
import tempfile
from pathlib import Path

from eaglenest.demo.kimi import ROPE_THETA, YARN, package_as_kimi
from kimi_tokenizer import build_kimi_tokenizer
from tiny_deepseek import build_tiny_deepseek


def build_plain_twin(out_dir, *, tied=False, seed=0, **overrides):
    """The plain tiny DeepSeek-V3 that build_kimi_target(..., tied, seed) wraps; return its config."""
    return build_tiny_deepseek(out_dir, seed=seed, tie_word_embeddings=tied, rope_scaling=YARN, rope_theta=ROPE_THETA,
                               **overrides)


def build_kimi_target(out_dir, *, tied=False, seed=0, tokenizer=False):
    """Write the tiny Kimi-packaged target to `out_dir`; return its config.json dict.

    tied: no lm_head tensor and tie_word_embeddings true (in text_config and the wrapper, as Kimi
    states its settings in both), else an untied language_model.lm_head.weight.
    tokenizer: with Kimi's kind of remote-code tokenizer (tests/kimi_tokenizer.py), the
    vocabulary sized to fit it.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {}
    if tokenizer:
        build_kimi_tokenizer(out_dir)  # its config.json, with the vocab size, is replaced below
        vocab = {"vocab_size": json.loads((out_dir / "config.json").read_text())["vocab_size"]}
    with tempfile.TemporaryDirectory() as plain_dir:
        build_plain_twin(plain_dir, tied=tied, seed=seed, **vocab)
        config = package_as_kimi(plain_dir, out_dir, seed=seed)
    weights = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("language_model.lm_head.weight" not in weights) == tied, "transformers saves a tied head only as embed_tokens"
    assert "head_dim" not in config["text_config"]
    return config
