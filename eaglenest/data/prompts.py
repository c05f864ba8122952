"""Conversations: the prompts the target answers (generate) and the messages of response records.

Kept apart from records.py so that editing how responses are read never makes responses
regenerate.
"""

from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import Fields, check_new_id, object_fields, read_jsonl

ROLES = ("system", "user", "assistant")


def parse_messages(fields):
    """The "messages" field: a non-empty list of {role, content} ending with a user turn."""
    messages = fields.get("messages", list)
    if not messages:
        raise fields.error("messages", "empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise fields.error(f"messages[{i}]", f"expected object, got {type(message).__name__}")
        m = Fields(fields.where, message, f"{fields.prefix}messages[{i}].")
        role = m.get("role", str)
        if role not in ROLES:
            raise m.error("role", f"expected one of {ROLES}, got {role!r}")
        out.append({"role": role, "content": m.get("content", str)})
    if out[-1]["role"] != "user":
        raise fields.error(f"messages[{len(out) - 1}].role", "the prompt must end with a user message")
    return out


def read_prompts(path):
    """Prompts to generate responses for: JSONL of {"id", "messages"} -> [(id, messages, where)]."""
    prompts, seen = [], {}
    for where, obj in read_jsonl(path):
        f = object_fields(where, obj)
        prompt_id, messages = f.get("id", str), parse_messages(f)
        check_new_id(prompt_id, where, seen)
        prompts.append((prompt_id, messages, where))
    if not prompts:
        raise InputError(f"{path}: no prompts (empty file)")
    return prompts
