"""Conversations: the prompts the target answers (generate) and the messages of response records.

Kept apart from records.py so that editing how responses are read never makes responses
regenerate.
"""

import json

from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import Fields, check_new_id, object_fields, read_jsonl

ROLES = ("system", "user", "assistant")


def parse_turns(fields, field="messages", role_key="role", content_key="content", roles=None):
    """The non-empty list `field` of {role_key, content_key} -> [{role, content}], each role one
    of `roles` ({as written: role}; None: ROLES as they are). Errors name the turn and its field."""
    roles = roles or {role: role for role in ROLES}
    turns = fields.get(field, list)
    if not turns:
        raise fields.error(field, "empty conversation")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise fields.error(f"{field}[{i}]", f"expected object, got {type(turn).__name__}")
        t = Fields(fields.where, turn, f"{fields.prefix}{field}[{i}].")
        role = t.get(role_key, str)
        if role not in roles:
            raise t.error(role_key, f"{role!r} is no role the chat template takes ({', '.join(roles)})")
        out.append({"role": roles[role], "content": t.get(content_key, str)})
    return out


def parse_messages(fields):
    """The "messages" field of a prompt: parse_turns ending with a user turn."""
    out = parse_turns(fields)
    if out[-1]["role"] != "user":
        raise fields.error(f"messages[{len(out) - 1}].role", "the prompt must end with a user message")
    return out


def parse_id(fields, *, optional=False):
    """The "id" field: a non-empty string, or an integer, which becomes its decimal string (every
    id eaglenest writes is a string); None where it is absent or null and `optional`."""
    value = fields.obj.get("id")
    if value is None and optional:
        return None
    if "id" not in fields.obj:
        raise fields.error("id", "missing")
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise fields.error("id", f"expected a non-empty string or an integer, got {json.dumps(value)}")
    return str(value)


def read_prompts(path):
    """Prompts to generate responses for: JSONL of {"id", "messages"} -> [(id, messages, where)],
    each id a string (parse_id)."""
    prompts, seen = [], {}
    for where, obj in read_jsonl(path):
        f = object_fields(where, obj)
        prompt_id, messages = parse_id(f), parse_messages(f)
        check_new_id(prompt_id, where, seen)
        prompts.append((prompt_id, messages, where))
    if not prompts:
        raise InputError(f"{path}: no prompts (empty file)")
    return prompts
