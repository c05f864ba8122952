"""Reading tokenized_data.jsonl: {"id", "input_ids", "loss_mask"} per line."""

import json


def read_tokenized(path):
    """Yield tokenized samples in file order."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)
