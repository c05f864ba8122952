"""Conversations: the prompts the target answers (generate) and the messages of response records.

Kept apart from records.py so that editing how responses are read never makes responses
regenerate.

Tool use, in the OpenAI form (docs/DATA.md "Tools"): a prompt's optional `tools` (JSON-schema
functions, each {"type": "function", "function": {name, ...}}), assistant turns with `tool_calls`
([{id, type: "function", function: {name, arguments}}], arguments a JSON object or a string
holding one, kept as given: templates differ in what they render) and `tool` turns answering a
call by its `tool_call_id`. A call without an id gets Kimi's own, `functions.NAME:IDX` (IDX
counting the calls of the conversation from 0), and a tool turn without one answers the first
call not yet answered, as ShareGPT-style tool sets (`observation` turns) have it.
"""

import json
from typing import NamedTuple

from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import Fields, check_new_id, object_fields, read_jsonl

ROLES = ("system", "user", "assistant", "tool")
ASKING = ("user", "tool")  # the turns an assistant turn answers: a prompt ends with one


class Prompt(NamedTuple):
    """One prompt as read: its id, messages, tools (None: none declared) and where it was read."""

    id: str
    messages: list
    tools: list | None
    where: str


def _present(obj, key):
    """The value of `key`, None where it is absent or null (a Parquet struct column holds every
    field of every turn, null where a turn has none)."""
    return obj.get(key) if isinstance(obj, dict) else None


def parse_arguments(fields, key="arguments"):
    """A call's arguments: a JSON object, or a string holding one, kept as given."""
    value = fields.obj.get(key)
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            if isinstance(json.loads(value), dict):
                return value
        except json.JSONDecodeError:
            pass
    shown = json.dumps(value, ensure_ascii=False)
    raise fields.error(key, "expected a JSON object or a string holding one, got "
                            + (shown if len(shown) <= 60 else shown[:57] + "..."))


def parse_call(t, calls):
    """One entry of `tool_calls` (Fields `t`) -> {id, type, function: {name, arguments}}; `calls`:
    the calls of the conversation so far (its index names a call without an id)."""
    function = t.sub("function")
    name = function.obj.get("name")
    if not isinstance(name, str) or not name:
        raise function.error("name", "a tool call needs a function name" if name in (None, "") else
                             f"expected a non-empty string, got {type(name).__name__}")
    call_id = _present(t.obj, "id")
    if call_id is not None and (not isinstance(call_id, str) or not call_id):
        raise t.error("id", f"expected a non-empty string, got {json.dumps(call_id)}")
    call_id = call_id or f"functions.{name}:{len(calls)}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parse_arguments(function)}}


class _Calls:
    """The tool calls of one conversation, and those not answered yet (in order)."""

    def __init__(self):
        self.all, self.pending = [], []

    def add(self, t, field):
        entries = t.obj.get(field)
        if not isinstance(entries, list) or not entries:
            raise t.error(field, "expected a non-empty list of calls")
        out = []
        for j, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise t.error(f"{field}[{j}]", f"expected object, got {type(entry).__name__}")
            call = parse_call(Fields(t.where, entry, f"{t.prefix}{field}[{j}]."), self.all)
            self.all.append(call)
            out.append(call)
        self.pending += [c["id"] for c in out]
        return out

    def answer(self, t, role_key, key):
        """The id of the call a tool turn answers: its `key` when given, else the first pending."""
        call_id = _present(t.obj, key)
        if call_id is None:
            if not self.pending:
                raise t.error(role_key, "a tool turn answering no call (no tool call before it is unanswered)")
            return self.pending.pop(0)
        if call_id not in self.pending:
            raise t.error(key, f"{call_id!r} answers no call (unanswered: {', '.join(self.pending) or 'none'})")
        self.pending.remove(call_id)
        return call_id


def parse_turns(fields, field="messages", role_key="role", content_key="content", roles=None):
    """The non-empty list `field` of {role_key, content_key} -> [{role, content}], each role one
    of `roles` ({as written: role}; None: ROLES as they are), assistant turns with tool_calls also
    carrying them (content null or absent: ""), tool turns their tool_call_id. roles may map
    a role to "tool_call" (an assistant turn whose content is the JSON of its calls, {name,
    arguments} or a list of them: ShareGPT's function_call), merged into the assistant turn just
    before it. Errors name the turn and its field."""
    roles = roles or {role: role for role in ROLES}
    turns = fields.get(field, list)
    if not turns:
        raise fields.error(field, "empty conversation")
    out, calls = [], _Calls()
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise fields.error(f"{field}[{i}]", f"expected object, got {type(turn).__name__}")
        t = Fields(fields.where, turn, f"{fields.prefix}{field}[{i}].")
        role = t.get(role_key, str)
        if role not in roles:
            raise t.error(role_key, f"{role!r} is no role the chat template takes ({', '.join(roles)})")
        role = roles[role]
        if role == "tool_call":
            new = _function_calls(t, content_key, calls)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).extend(new)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": new})
            continue
        has_calls = role == "assistant" and _present(turn, "tool_calls") is not None
        content = (t.get(content_key, str, optional=True, allow_none=True) or "") if has_calls else t.get(content_key, str)
        message = {"role": role, "content": content}
        if has_calls:
            message["tool_calls"] = calls.add(t, "tool_calls")
        if role == "tool":
            message["tool_call_id"] = calls.answer(t, role_key, "tool_call_id")
        out.append(message)
    return out


def _function_calls(t, content_key, calls):
    """The calls of a ShareGPT function_call turn, its value the JSON of one call {name,
    arguments} or of a list of them."""
    text = t.get(content_key, str)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise t.error(content_key, f"a function call must be JSON {{name, arguments}}: {e.msg}") from None
    entries = value if isinstance(value, list) else [value]
    wrapped = Fields(t.where, {"calls": [{"function": e} if isinstance(e, dict) else e for e in entries]},
                     f"{t.prefix}{content_key}.")
    return calls.add(wrapped, "calls")


def parse_tools(fields, field="tools"):
    """The optional tool declarations: a list (or a JSON string of one, as Glaive and xLAM store
    them) of {"type": "function", "function": {name, ...}}, or of the bare function, which is
    wrapped so; None where absent, null or empty."""
    value = fields.obj.get(field)
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise fields.error(field, f"a JSON string of tools, but not JSON: {e.msg}") from None
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise fields.error(field, f"expected a list of tools, got {type(value).__name__}")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise fields.error(f"{field}[{i}]", f"expected object, got {type(tool).__name__}")
        wrapped = isinstance(tool.get("function"), dict)
        tool = tool if wrapped else {"type": "function", "function": tool}
        name = tool["function"].get("name")
        if not isinstance(name, str) or not name:
            raise fields.error(f"{field}[{i}]{'.function' if wrapped else ''}.name", "a tool needs a function name")
        tools.append({k: v for k, v in tool.items() if v is not None})
    return tools


def parse_messages(fields):
    """The "messages" field of a prompt: parse_turns ending with a user or tool turn."""
    out = parse_turns(fields)
    if out[-1]["role"] not in ASKING:
        raise fields.error(f"messages[{len(out) - 1}].role", "the prompt must end with a user or tool message")
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


def prompt_line(prompt_id, messages, tools):
    """A prompt as eaglenest writes it: {"id", "messages"}, and "tools" when it declares any."""
    return {"id": prompt_id, "messages": messages, **({"tools": tools} if tools else {})}


def read_prompts(path):
    """Prompts to generate responses for: JSONL of {"id", "messages", "tools"?} -> [Prompt], each
    id a string (parse_id)."""
    prompts, seen = [], {}
    for where, obj in read_jsonl(path):
        f = object_fields(where, obj)
        prompt_id, messages, tools = parse_id(f), parse_messages(f), parse_tools(f)
        check_new_id(prompt_id, where, seen)
        prompts.append(Prompt(prompt_id, messages, tools, where))
    if not prompts:
        raise InputError(f"{path}: no prompts (empty file)")
    return prompts
