"""Facts about the target model read from its config.json, without loading any weights."""

import json
from pathlib import Path


def _config_json(target_dir):
    return json.loads((Path(target_dir) / "config.json").read_text())


def target_config(target_dir):
    """The target's config.json as a dict; for multimodal configs, the text model's part."""
    config = _config_json(target_dir)
    return config.get("text_config", config)


def target_architectures(target_dir):
    """The target's top-level `architectures` (what a drafter config names as its verifier)."""
    return _config_json(target_dir).get("architectures")
