"""Tokenized samples (tokenized_data.jsonl: {"id", "input_ids", "loss_mask"} per line) and the
held-out split that every later stage computes from a sample's id."""

import hashlib

from eaglenest.workflow.jsonl import read_objects


def read_tokenized(path):
    """Yield tokenized samples in file order."""
    return read_objects(path)


def is_heldout(sample_id, fraction):
    """Held-out iff a hash of the id falls below `fraction`: no sample ever changes side when
    samples are added, and every stage computes the same split from the id alone."""
    digest = hashlib.sha256(str(sample_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64
