"""Tokenized samples (tokenized_data.jsonl: {"id", "input_ids", "loss_mask"} per line) and the
held-out split that every later stage computes from a sample's id."""

import hashlib
import re

from eaglenest.workflow.jsonl import read_objects


def read_tokenized(path):
    """Yield tokenized samples in file order."""
    return read_objects(path)


def prompt_id_of(sample_id):
    """The prompt a sample answers: the id before its last '#' when only digits follow it (an
    answer id, `{prompt id}#{j}`, docs/TOKENIZATION.md "Answer ids"), else the id itself."""
    prompt_id, sep, index = str(sample_id).rpartition("#")
    return prompt_id if sep and re.fullmatch("[0-9]+", index) else str(sample_id)


def is_heldout(sample_id, fraction):
    """Held-out iff a hash of the sample's prompt id falls below `fraction`: every answer of a
    prompt is on the same side (the evaluation never sees a prompt training learned), no sample
    ever changes side when samples are added, and every stage computes the same split from the id."""
    digest = hashlib.sha256(prompt_id_of(sample_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64
