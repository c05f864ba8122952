"""Facts about the target model read from its config.json, without loading any weights."""

import json
from pathlib import Path


def target_config(target_dir):
    """The target's config.json as a dict; for multimodal configs, the text model's part."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return config.get("text_config", config)
