"""A tiny target packaged as Kimi-K2.5 ships (docs/PITFALLS.md, "Kimi-K2.5 as it ships"), built
locally from the tiny DeepSeek-V3 of tests/tiny_deepseek.py.

The text model is that DeepSeek-V3 with YaRN rope scaling. It is wrapped as Kimi-K2.5 wraps its
own: a `kimi_k25` config.json whose `text_config` holds the text model in Kimi's form (model_type
`kimi_k2`, `rope_scaling` with `type: yarn`, no `head_dim`), an `auto_map` naming remote code
that is not there, and a vision_config. Its weights carry the `language_model.` prefix, sit
next to vision-tower and projector tensors, and are split over two safetensors files with a
`model.safetensors.index.json`. `build_plain_twin` writes the same text model as a plain
checkpoint, so that tests can hold every reading of the wrapper against the plain model.
"""

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kimi_tokenizer import build_kimi_tokenizer
from tiny_deepseek import build_tiny_deepseek

PREFIX = "language_model."
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0)  # Kimi-K2.5's form of rope_scaling (its figures are larger)
ROPE_THETA = 50000.0
AUTO_MAP = {  # Kimi's remote code, which nothing here runs: the files are not written
    "AutoConfig": "configuration_kimi_k25.KimiK25Config",
    "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
}
VISION_CONFIG = {"patch_size": 14, "vt_hidden_size": 16, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 2,
                 "mm_hidden_size": 16, "text_hidden_size": 128, "merge_kernel_size": [2, 2]}
VISION_TENSORS = {"vision_tower.patch_embed.proj.weight": (16, 3, 14, 14), "mm_projector.proj.0.weight": (128, 64)}
# Keys transformers derives from others and writes into config.json, which Kimi's text_config lacks.
DERIVED_KEYS = ("head_dim", "qk_head_dim", "transformers_version")


def build_plain_twin(out_dir, *, tied=False, seed=0, **overrides):
    """The plain tiny DeepSeek-V3 that build_kimi_target(..., tied, seed) wraps; return its config."""
    return build_tiny_deepseek(out_dir, seed=seed, tie_word_embeddings=tied, rope_scaling=YARN, rope_theta=ROPE_THETA,
                               **overrides)


def kimi_text_config(plain_config):
    """A plain DeepSeek-V3 config.json dict -> the same model as Kimi-K2.5's text_config."""
    text = {key: value for key, value in plain_config.items() if key not in DERIVED_KEYS}
    rope = dict(text.pop("rope_parameters"))
    text["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_type")  # Kimi names the type "type"
    text["rope_scaling"] = rope
    text["torch_dtype"] = text.pop("dtype")
    text["model_type"] = "kimi_k2"
    return text


def write_sharded(tensors, out_dir, num_files=2):
    """`tensors` split over `num_files` safetensors files, with the index that names each one's file."""
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_files):
        file = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        part = names[i * len(names) // num_files:(i + 1) * len(names) // num_files]
        save_file({name: tensors[name] for name in part}, Path(out_dir) / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in part})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (Path(out_dir) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


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
        plain_config = json.loads((Path(plain_dir) / "config.json").read_text())
        weights = load_file(Path(plain_dir) / "model.safetensors")
    assert ("lm_head.weight" not in weights) == tied, "transformers saves a tied head only as embed_tokens"
    tensors = {PREFIX + name: tensor for name, tensor in weights.items()}
    generator = torch.Generator().manual_seed(seed)
    tensors.update({name: torch.randn(shape, generator=generator) for name, shape in VISION_TENSORS.items()})
    write_sharded(tensors, out_dir)
    text_config = kimi_text_config(plain_config)
    assert "head_dim" not in text_config
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": AUTO_MAP,
        "torch_dtype": text_config["torch_dtype"],
        "tie_word_embeddings": tied,
        "eos_token_id": text_config["eos_token_id"],
        "text_config": text_config,
        "vision_config": VISION_CONFIG,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return config
