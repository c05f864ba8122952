"""Reading JSONL files, with errors that name the file, the line and the field.

The one reader of every JSONL file the stages read: prompts, response records, tokenized samples,
shard parts, the demo corpus.
"""

import json

from eaglenest.workflow.errors import InputError


def jsonl_lines(path):
    """(where, line, object) for each non-blank line of a JSONL file, where = "file:line" and line
    the text as read (for copying lines verbatim); malformed JSON raises InputError naming the
    line and column, text that is not UTF-8 the last line read before it (text is decoded in blocks)."""
    with open(path, encoding="utf-8") as f:
        line_no = 0
        try:
            for line_no, text in enumerate(f, 1):
                if not text.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    yield where, text, json.loads(text)
                except json.JSONDecodeError as e:
                    raise InputError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
        except UnicodeDecodeError:
            raise InputError(f"{path}: not UTF-8 text" + (f" after line {line_no}" if line_no else "")) from None


def read_jsonl(path):
    """(where, object) for each non-blank line of a JSONL file (see jsonl_lines)."""
    return ((where, obj) for where, _, obj in jsonl_lines(path))


def read_objects(path):
    """The objects of a JSONL file, in order (see read_jsonl)."""
    return (obj for _, obj in read_jsonl(path))


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


def object_fields(where, obj):
    """Fields of a line's value, which must be a JSON object."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return Fields(where, obj)


def check_new_id(record_id, where, seen):
    """Record `record_id` as seen at `where`; a second sighting is an InputError."""
    if record_id in seen:
        raise InputError(f"{where}: field 'id': duplicate id {record_id!r} (first on line {seen[record_id]})")
    seen[record_id] = where.rsplit(":", 1)[1]
