"""Dataset records in the shapes people have, turned into the prompts the target answers.

Shapes (docs/DATA.md):
- prompts: eaglenest's own {"id", "messages"}, ending with a user turn: one prompt, as it is;
- messages: OpenAI/UltraChat, "messages" of {role, content}, with tool calls and tool turns
  (eaglenest.data.prompts) and the record's "tools";
- sharegpt: "conversations" of {from: human|gpt|system, value}, tool sets (Glaive, xLAM) also
  function_call (the JSON of the calls) and observation (a tool's result), tools a JSON string;
- instruction: Alpaca/Magpie, "instruction" (+ "input"), its answer in "output" or "response".

A conversation (every shape but prompts) gives one prompt per assistant turn that follows a user
or tool turn, the prompt being the conversation before that turn, earlier assistant turns as the dataset
has them; and one more when it ends with a user turn. The target answers each prompt in its own
words, independently of the others (so any part can answer it).
"""

import hashlib
import json

from eaglenest.data.prompts import ASKING, parse_id, parse_messages, parse_tools, parse_turns
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import Fields

SHAPES = ("prompts", "messages", "sharegpt", "instruction")
# The field that tells each shape, in the order auto-detection tries them (Magpie records often carry
# both "conversations" and "instruction": the conversation is the fuller one)
SHAPE_FIELDS = {"sharegpt": "conversations", "messages": "messages", "instruction": "instruction"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "tool_call", "observation": "tool", "tool": "tool"}


def detect_shape(where, record):
    """The shape of a record by its fields ("messages" reads as a conversation: name the shape
    `prompts` to take records as prompts as they are)."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for shape, field in SHAPE_FIELDS.items():
        if field in record:
            return shape
    raise InputError(f"{where}: unknown record shape: no field 'conversations' (ShareGPT), 'messages' "
                     f"(OpenAI/UltraChat) or 'instruction' (Alpaca/Magpie); its fields: {', '.join(sorted(record))}")


def _instruction(fields):
    """[user: instruction, then input after a blank line when there is one] and the answer, if
    any, as an assistant turn (regenerated like any other)."""
    instruction = fields.get("instruction", str)
    if not instruction.strip():
        raise fields.error("instruction", "empty")
    extra = fields.get("input", str, optional=True, allow_none=True)
    user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    answer = next((fields.get(key, str, allow_none=True) for key in ("output", "response") if key in fields.obj), None)
    return [{"role": "user", "content": user}] + ([{"role": "assistant", "content": answer}] if answer else [])


def conversation(where, record, shape):
    """The record's (messages [{role, content, ...}], tools or None), checked; errors name `where`
    and the field."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    fields = Fields(where, record)
    if shape == "prompts":
        return parse_messages(fields), parse_tools(fields)
    if shape == "instruction":
        return _instruction(fields), None
    if shape == "sharegpt":
        return parse_turns(fields, "conversations", "from", "value", SHAREGPT_ROLES), parse_tools(fields)
    return parse_turns(fields), parse_tools(fields)


def record_id(where, record, messages, tools=None):
    """The record's "id" (prompts.parse_id: a string, or an integer as its string), else one
    derived from its content: the first 16 hex digits of the sha256 of canonical(messages, tools),
    so the same conversation always gets the same id and appending records never renames the
    others."""
    given = parse_id(Fields(where, record), optional=True)
    return given if given is not None else hashlib.sha256(canonical(messages, tools).encode()).hexdigest()[:16]


def canonical(messages, tools=None):
    """Messages (and, where there are any, {"messages", "tools"}) as canonical JSON: what a
    content id and the duplicate check compare; a conversation without tools keeps the id it
    always had."""
    value = {"messages": messages, "tools": tools} if tools else messages
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompts_of(conversation_id, messages, shape):
    """[(prompt id, messages)] of one record. prompts: the record itself. A conversation: the
    messages before each assistant turn that follows a user or tool turn, and the whole
    conversation when it ends with one; one prompt keeps the record's id, several are
    `{id}@{n}`, n from 1."""
    if shape == "prompts":
        return [(conversation_id, messages)]
    cuts = [i for i in range(1, len(messages)) if messages[i]["role"] == "assistant" and messages[i - 1]["role"] in ASKING]
    if messages[-1]["role"] in ASKING:
        cuts.append(len(messages))
    if len(cuts) == 1:
        return [(conversation_id, messages[: cuts[0]])]
    return [(f"{conversation_id}@{n}", messages[:cut]) for n, cut in enumerate(cuts, 1)]
