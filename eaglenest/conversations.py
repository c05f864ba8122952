"""Conversations from JSONL files, with errors that name the file, the line and the field.

Shared by the prompts the target answers (generate) and the response records (records): kept
apart from both so that editing how responses are read never makes responses regenerate.
"""

import json

from eaglenest.stage import InputError

ROLES = ("system", "user", "assistant")


class Fields:
    """Typed field access on one JSON object; every error names file:line and the field path."""

    def __init__(self, where, obj, prefix=""):
        self.where, self.obj, self.prefix = where, obj, prefix

    def error(self, field, problem):
        return InputError(f"{self.where}: field '{self.prefix}{field}': {problem}")

    def get(self, field, kind, *, optional=False, allow_none=False):
        if field not in self.obj:
            if optional:
                return None
            raise self.error(field, "missing")
        value = self.obj[field]
        if value is None and allow_none:
            return None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise self.error(field, f"expected {names}, got {type(value).__name__}")
        return value

    def sub(self, field, kind=dict):
        return Fields(self.where, self.get(field, kind), f"{self.prefix}{field}.")

    def token_ids(self, field):
        ids = self.get(field, list, optional=True, allow_none=True)
        if ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise self.error(field, "expected a list of non-negative integers")
        return ids


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


def json_lines(path):
    """(where, object) for each non-blank line of a JSONL file; malformed JSON raises InputError."""
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None


def check_new_id(record_id, where, seen):
    """Record `record_id` as seen at `where`; a second sighting is an InputError."""
    if record_id in seen:
        raise InputError(f"{where}: field 'id': duplicate id {record_id!r} (first on line {seen[record_id]})")
    seen[record_id] = where.rsplit(":", 1)[1]


def read_prompts(path):
    """Prompts to generate responses for: JSONL of {"id", "messages"} -> [(id, messages, where)]."""
    prompts, seen = [], {}
    for where, obj in json_lines(path):
        if not isinstance(obj, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        f = Fields(where, obj)
        prompt_id, messages = f.get("id", str), parse_messages(f)
        check_new_id(prompt_id, where, seen)
        prompts.append((prompt_id, messages, where))
    if not prompts:
        raise InputError(f"{path}: no prompts (empty file)")
    return prompts
