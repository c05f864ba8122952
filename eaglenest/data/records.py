"""Reading raw response records, with errors that name the file, the line and the field.

Two record shapes are accepted (README "Input records", docs/CONTRACTS.md):
  canonical  {"id", "messages", "reasoning_content", "content", "finish_reason",
              optional "prompt_token_ids", "completion_token_ids"}
  openai     {"id"?, "messages", "response": <chat.completion object>} where the response's
             choices[0] holds message.reasoning_content (or .reasoning), message.content,
             finish_reason and, from vLLM with return_token_ids, token_ids; the response
             holds prompt_token_ids.
Both become one Record.
"""

from dataclasses import dataclass

from eaglenest.data.prompts import parse_messages
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import Fields, check_new_id, object_fields, read_jsonl

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


def _finish_reason(fields, field):
    reason = fields.get(field, str)
    if reason not in FINISH_REASONS:
        raise fields.error(field, f"expected one of {FINISH_REASONS}, got {reason!r} (tool calls are not supported)")
    return reason


def parse_record(obj, where):
    """One JSON object (either shape) → Record."""
    f = object_fields(where, obj)
    messages = parse_messages(f)
    if "response" in obj:
        response = f.sub("response")
        choices = response.get("choices", list)
        if not choices or not isinstance(choices[0], dict):
            raise response.error("choices", "expected a non-empty list of objects")
        choice = Fields(where, choices[0], f"{response.prefix}choices[0].")
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
    for where, obj in read_jsonl(path):
        record = parse_record(obj, where)
        if (record.prompt_token_ids is None) != (record.completion_token_ids is None):
            raise InputError(f"{where}: field 'prompt_token_ids'/'completion_token_ids': give both or neither")
        check_new_id(record.id, where, seen)
        records.append(record)
    if not records:
        raise InputError(f"{path}: no records (empty file)")
    return records
