"""Reading raw response records, with errors that name the file, the line and the field.

Two record shapes are accepted (docs/TOKENIZATION.md "Input records", docs/CONTRACTS.md):
  canonical  {"id", "messages", "content", "finish_reason", optional "reasoning_content",
              "reasoning_closed", "temperature", "prompt_token_ids", "completion_token_ids"} (no
              reasoning fields: a response without a think block, as a target without one writes)
  openai     {"id"?, "messages", "response": <chat.completion object>} where the response's
             choices[0] holds message.reasoning_content (or .reasoning), message.content,
             finish_reason and, from vLLM with return_token_ids, token_ids; the response
             holds prompt_token_ids; "reasoning_closed" and "temperature", optional, sit beside
             "messages".
Both become one Record; either may carry the prompt's "tools" beside "messages". A turn that
called tools (finish_reason "tool_calls", as vLLM's server says it with a tool parser on, or a
message with tool_calls) is kept only from its token ids, and is then a turn that stopped: the
text a tool parser leaves does not say which tokens the target emitted.
"""

from dataclasses import dataclass

from eaglenest.data.prompts import parse_messages, parse_tools
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
    reasoning_closed: bool | None  # the model emitted </think>; None: the record does not say
    prompt_token_ids: list | None
    completion_token_ids: list | None
    where: str  # "file:line", for error messages downstream
    temperature: float | None = None  # what it was sampled at; None: the record does not say
    tools: list | None = None  # the prompt's tool declarations; None: it declares none


def _finish_reason(fields, field, has_ids, called=False):
    """The finish reason, "stop" or "length"; "tool_calls" (or a turn that `called` tools) only
    with token ids, where it reads as "stop"."""
    reason = fields.get(field, str)
    if reason == "tool_calls" or called:
        if not has_ids:
            raise fields.error(field, "a turn with tool calls is kept only from its token ids (prompt_token_ids and "
                                      "completion_token_ids, vLLM's return_token_ids)")
        return "stop" if reason == "tool_calls" else reason
    if reason not in FINISH_REASONS:
        raise fields.error(field, f"expected one of {FINISH_REASONS} (or tool_calls, with token ids), got {reason!r}")
    return reason


def _temperature(f):
    """The optional "temperature": a number >= 0 (generate_part writes it; records made elsewhere lack it)."""
    temperature = f.get("temperature", (int, float), optional=True)
    if isinstance(temperature, bool) or (temperature is not None and temperature < 0):
        raise f.error("temperature", f"expected a number >= 0, got {temperature!r}")
    return temperature


def _openai_fields(f):
    """The Record fields held by an OpenAI-shaped object's "response"."""
    response = f.sub("response")
    choices = response.get("choices", list)
    if not choices or not isinstance(choices[0], dict):
        raise response.error("choices", "expected a non-empty list of objects")
    choice = Fields(f.where, choices[0], f"{response.prefix}choices[0].")
    message = choice.sub("message")
    reasoning = message.get("reasoning_content", str, optional=True, allow_none=True)
    if reasoning is None:
        reasoning = message.get("reasoning", str, optional=True, allow_none=True)
    prompt_ids, completion_ids = response.token_ids("prompt_token_ids"), choice.token_ids("token_ids")
    return dict(
        id=f.get("id", str, optional=True) or response.get("id", str),
        reasoning_content=reasoning or "",
        content=message.get("content", str, allow_none=True) or "",
        finish_reason=_finish_reason(choice, "finish_reason", completion_ids is not None,
                                     called=bool(message.obj.get("tool_calls"))),
        prompt_token_ids=prompt_ids,
        completion_token_ids=completion_ids,
    )


def parse_record(obj, where):
    """One JSON object (either shape) → Record."""
    f = object_fields(where, obj)
    messages = parse_messages(f)
    if "response" in obj:
        fields = _openai_fields(f)
    else:
        fields = dict(
            id=f.get("id", str),
            reasoning_content=f.get("reasoning_content", str, optional=True) or "",
            content=f.get("content", str),
            finish_reason=_finish_reason(f, "finish_reason", f.token_ids("completion_token_ids") is not None),
            prompt_token_ids=f.token_ids("prompt_token_ids"),
            completion_token_ids=f.token_ids("completion_token_ids"),
        )
    closed = f.get("reasoning_closed", bool, optional=True, allow_none=True)
    if closed is False and fields["content"]:
        raise f.error("reasoning_closed", "false, but there is content (content is what follows </think>)")
    return Record(messages=messages, reasoning_closed=closed, where=where, temperature=_temperature(f),
                  tools=parse_tools(f), **fields)


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
