"""Reading raw response records, with errors that name the file, the line and the field.

Two record shapes are accepted (README "Input records"):
  canonical  {"id", "messages", "reasoning_content", "content", "finish_reason",
              optional "prompt_token_ids", "completion_token_ids"}
  openai     {"id"?, "messages", "response": <chat.completion object>} where the response's
             choices[0] holds message.reasoning_content (or .reasoning), message.content,
             finish_reason and, from vLLM with return_token_ids, token_ids; the response
             holds prompt_token_ids.
Both become one Record.
"""

import json
from dataclasses import dataclass

from eaglenest.stage import InputError

ROLES = ("system", "user", "assistant")
FINISH_REASONS = ("stop", "length")


@dataclass
class Record:
    id: str
    messages: list
    reasoning_content: str
    content: str
    finish_reason: str
    prompt_token_ids: list | None
    completion_token_ids: list | None
    where: str  # "file:line", for error messages downstream


class _Fields:
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
        return _Fields(self.where, self.get(field, kind), f"{self.prefix}{field}.")

    def token_ids(self, field):
        ids = self.get(field, list, optional=True, allow_none=True)
        if ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise self.error(field, "expected a list of non-negative integers")
        return ids


def _messages(fields):
    messages = fields.get("messages", list)
    if not messages:
        raise fields.error("messages", "empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise fields.error(f"messages[{i}]", f"expected object, got {type(message).__name__}")
        m = _Fields(fields.where, message, f"{fields.prefix}messages[{i}].")
        role = m.get("role", str)
        if role not in ROLES:
            raise m.error("role", f"expected one of {ROLES}, got {role!r}")
        out.append({"role": role, "content": m.get("content", str)})
    if out[-1]["role"] != "user":
        raise fields.error(f"messages[{len(out) - 1}].role", "the prompt must end with a user message")
    return out


def _finish_reason(fields, field):
    reason = fields.get(field, str)
    if reason not in FINISH_REASONS:
        raise fields.error(field, f"expected one of {FINISH_REASONS}, got {reason!r} (tool calls are not supported)")
    return reason


def parse_record(obj, where):
    """One JSON object (either shape) → Record."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    f = _Fields(where, obj)
    messages = _messages(f)
    if "response" in obj:
        response = f.sub("response")
        choices = response.get("choices", list)
        if not choices or not isinstance(choices[0], dict):
            raise response.error("choices", "expected a non-empty list of objects")
        choice = _Fields(where, choices[0], f"{response.prefix}choices[0].")
        message = choice.sub("message")
        reasoning = message.get("reasoning_content", str, optional=True, allow_none=True)
        if reasoning is None:
            reasoning = message.get("reasoning", str, optional=True, allow_none=True)
        record_id = f.get("id", str, optional=True) or response.get("id", str)
        return Record(
            id=record_id,
            messages=messages,
            reasoning_content=reasoning or "",
            content=message.get("content", str, allow_none=True) or "",
            finish_reason=_finish_reason(choice, "finish_reason"),
            prompt_token_ids=response.token_ids("prompt_token_ids"),
            completion_token_ids=choice.token_ids("token_ids"),
            where=where,
        )
    return Record(
        id=f.get("id", str),
        messages=messages,
        reasoning_content=f.get("reasoning_content", str),
        content=f.get("content", str),
        finish_reason=_finish_reason(f, "finish_reason"),
        prompt_token_ids=f.token_ids("prompt_token_ids"),
        completion_token_ids=f.token_ids("completion_token_ids"),
        where=where,
    )


def read_records(path):
    """All records of a JSONL file; the first problem raises InputError (file:line: field: what)."""
    records, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
            record = parse_record(obj, where)
            if (record.prompt_token_ids is None) != (record.completion_token_ids is None):
                raise InputError(f"{where}: field 'prompt_token_ids'/'completion_token_ids': give both or neither")
            if record.id in seen:
                raise InputError(f"{where}: field 'id': duplicate id {record.id!r} (first on line {seen[record.id]})")
            seen[record.id] = line_no
            records.append(record)
    if not records:
        raise InputError(f"{path}: no records (empty file)")
    return records
