"""The target's tokenizer as the workflow uses it: faithful prompt rendering and the special ids.

Its own module because two stages use it: generate (what the target is asked) and tokenize
(the stream it is trained on); editing how records are read concerns only the latter.
What the stream must be: docs/TOKENIZATION.md, "Token stream". Why plain text needs a route of its
own, chosen by what the tokenizer is: docs/KIMI.md, "Tokenizer".
"""

import copy
import re
import sys

from eaglenest.workflow.errors import InputError

# Private-use characters mark where message contents sit in the rendered template.
_SLOT = re.compile("\ue000(\\d+)\ue001")
# Text with no special token in it, on which the plain-text route must agree with the tokenizer.
_ORDINARY = "Plain text: 12 + 30 = 42, isn't it?"
# The tokens of a target's tool-call section (config tokenize.tool_call_tokens; Kimi's:
# eaglenest.demo.kimi_tokenizer.TOOL_CALL_TOKENS): the section runs from section_begin to
# section_end, each call's arguments from argument_begin to call_end.
TOOL_CALL_TOKENS = ("section_begin", "call_begin", "argument_begin", "call_end", "section_end")


def load_tokenizer(target_dir, *, trust_remote_code):
    """The target's HF tokenizer; its own code (auto_map) runs only with `trust_remote_code`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise InputError(f"{target_dir}/tokenizer_config.json: field 'auto_map': the tokenizer is the target's "
                         "own code; set target.trust_remote_code: true to run it") from None


def special_token_id(hf, token):
    """The one id of `token` in `hf`'s vocabulary, looked up rather than encoded: what encoding
    its text gives depends on how the tokenizer's encode parses special tokens."""
    token_id = hf.convert_tokens_to_ids(token)
    if token_id is None or hf.convert_ids_to_tokens(token_id) != token:
        raise InputError(f"tokenizer {type(hf).__name__}: {token!r} is not one token of its vocabulary")
    return token_id


def tool_call_span(target_dir, *, trust_remote_code, tool_call_tokens):
    """The ids (section begin, section end) of the target's tool-call section, by the config's
    tokenize.tool_call_tokens; None where it names none."""
    if not tool_call_tokens:
        return None
    hf = load_tokenizer(target_dir, trust_remote_code=trust_remote_code)
    return tuple(special_token_id(hf, tool_call_tokens[name]) for name in ("section_begin", "section_end"))


def plain_text_route(hf):
    """(name, encode) for text whose special-token text must stay text, whatever `hf.encode`
    defaults to (remote code may ignore split_special_tokens: Kimi's does):
    - a tokenizer holding a tiktoken Encoding (Kimi's `.model`): the Encoding, disallowed_special=();
    - a fast tokenizer: a copy of its backend, told to encode special tokens as text (a copy, so
      that the flag never reaches the template's encoding);
    - any other: its encode with split_special_tokens=True.
    The Tokenizer probes the route before it trusts it."""
    tiktoken = sys.modules.get("tiktoken")  # a tokenizer can hold an Encoding only once tiktoken is loaded
    encodings = [v for v in vars(hf).values() if tiktoken and isinstance(v, tiktoken.Encoding)]
    if len(encodings) > 1:
        raise InputError(f"tokenizer {type(hf).__name__}: holds {len(encodings)} tiktoken Encodings; "
                         "which one encodes plain text is unknown")
    if encodings:
        return "tiktoken Encoding", lambda text: encodings[0].encode(text, disallowed_special=())
    if hf.is_fast:
        backend = copy.deepcopy(hf.backend_tokenizer)
        backend.encode_special_tokens = True
        return "tokenizers backend", lambda text: backend.encode(text, add_special_tokens=False).ids
    return "split_special_tokens=True", lambda text: hf.encode(text, add_special_tokens=False,
                                                                split_special_tokens=True)


class Tokenizer:
    """The target's HF tokenizer, its plain-text route, and the ids of the tokens the stream is built from.

    think_start and think_end are both None for a target without a reasoning block (Llama,
    Qwen2.5, SmolLM2...; the config allows both or neither, workflow.config.check_think_tokens): no
    prompt then opens a think block, and no record may carry reasoning. tool_call_tokens: the
    target's tool-call tokens by their TOOL_CALL_TOKENS names (None: the target has none named),
    whose ids `tool_calls` holds."""

    def __init__(self, target_dir, *, trust_remote_code, think_start, think_end, end_of_turn, chat_template_kwargs,
                 tool_call_tokens=None):
        self.hf = load_tokenizer(target_dir, trust_remote_code=trust_remote_code)
        self.template_kwargs = dict(chat_template_kwargs)
        tool_call_tokens = dict(tool_call_tokens or {})
        if tool_call_tokens and set(tool_call_tokens) != set(TOOL_CALL_TOKENS):
            raise InputError(f"config: tokenize.tool_call_tokens: expected the keys {', '.join(TOOL_CALL_TOKENS)}, got "
                             f"{', '.join(tool_call_tokens)}")
        stream = {token: special_token_id(self.hf, token) for token in
                  (think_start, think_end, end_of_turn, *tool_call_tokens.values()) if token is not None}
        self.end_of_turn = stream[end_of_turn]
        self.think_start, self.think_end = (stream[think_start], stream[think_end]) if think_start else (None, None)
        self.tool_calls = {name: stream[token] for name, token in tool_call_tokens.items()}
        self.route, self._plain = plain_text_route(self.hf)
        self._check_routes(stream)

    @property
    def reasons(self):
        """Whether the target has a reasoning block at all (think tokens configured)."""
        return self.think_start is not None

    def _check_routes(self, stream):
        """Refuse, rather than guess, a tokenizer whose plain-text route turns the text of any special
        or added token into a special id, or whose template route does not parse the stream's tokens
        (`stream`: their text -> id)."""
        hf, name = self.hf, type(self.hf).__name__
        special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
        special |= set(hf.all_special_ids) | set(stream.values())
        texts = {t.content for t in hf.added_tokens_decoder.values()} | set(hf.all_special_tokens) | set(stream)
        for text in sorted(texts):
            leaked = [i for i in self.text(text) if i in special]
            if leaked:
                raise InputError(f"tokenizer {name}: its plain-text route ({self.route}) encodes the text {text!r} "
                                 f"to special id {leaked[0]}: it offers no way to encode plain text, so text "
                                 "typed by a user would become control tokens")
        if self.text(_ORDINARY) != hf.encode(_ORDINARY, add_special_tokens=False):
            raise InputError(f"tokenizer {name}: its plain-text route ({self.route}) disagrees with its own "
                             f"encode on {_ORDINARY!r}, which holds no special token")
        for token, token_id in stream.items():
            if self.template(token) != [token_id]:
                raise InputError(f"tokenizer {name}: template text {token!r} does not encode to its one id")

    def text(self, text):
        """Encode text that must never produce special tokens (user, system and model text)."""
        return self._plain(text)

    def template(self, text):
        """Encode template text, whose special tokens are real."""
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=False)

    def thinking(self, prompt_ids):
        """Whether a rendered prompt leaves a think block open (it ends with <think>); never for a
        target without a reasoning block."""
        return self.reasons and prompt_ids[-1] == self.think_start

    def check_no_reasoning(self, record):
        """Refuse a record that carries reasoning for a target without a reasoning block: its text
        has no tokens to go between, so training on it would teach a stream the target never emits."""
        if self.reasons:
            return
        field = ("reasoning_content" if record.reasoning_content
                 else "reasoning_closed" if record.reasoning_closed is not None else None)
        if field:
            raise InputError(f"{record.where}: field '{field}': the record carries reasoning, but the target has no "
                             "reasoning block (tokenize.think_start and think_end are null)")

    def _render(self, messages, tools, where):
        """The chat template's text of `messages` (and `tools`) with the generation prompt; a
        template that fails on them is one InputError naming `where`."""
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                               **self.template_kwargs)
        except TemplateError as e:
            raise InputError(f"{where}: field 'messages': the target's chat template cannot render this prompt: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def prompt(self, messages, tools=None, *, where="prompt"):
        """Render the prompt with the generation prompt, with its tool declarations where it has
        any; message contents (tool results among them) are encoded as plain text, tool
        declarations and calls as the template writes them. A template that leaves the tools or
        the tool calls out (renders the same without them) cannot take the prompt: one InputError
        naming `where`, the prompt's file and line."""
        slotted = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self._render(slotted, tools, where)
        if tools and rendered == self._render(slotted, None, where):
            raise InputError(f"{where}: field 'tools': the target's chat template does not render tools (it renders "
                             "the prompt the same without them)")
        if any(m.get("tool_calls") for m in messages) and rendered == self._render(
                [{k: v for k, v in m.items() if k != "tool_calls"} for m in slotted], tools, where):
            raise InputError(f"{where}: field 'messages': the target's chat template does not render tool calls "
                             "(it renders the prompt the same without them)")
        parts = _SLOT.split(rendered)
        ids = self.template(parts[0])
        for slot, template_text in zip(parts[1::2], parts[2::2]):
            ids += self.text(messages[int(slot)]["content"]) + self.template(template_text)
        return ids

    def generated(self, record, thinking):
        """The tokens the model emitted for a record without token ids, rebuilt from its text.

        A think block counts as closed when the record says so (reasoning_closed) or, when it does
        not, when there is content: a </think> the model may not have emitted is never added. A
        tool call is not rebuilt from text: content holding the text of the tool-call section's
        first token is refused (the record must keep its token ids)."""
        if self.tool_calls:
            begin = self.hf.convert_ids_to_tokens(self.tool_calls["section_begin"])
            if begin in record.content or begin in record.reasoning_content:
                raise InputError(f"{record.where}: field 'content': a tool call ({begin}) in text: a turn with tool "
                                 "calls is kept only from the token ids the target emitted (prompt_token_ids and "
                                 "completion_token_ids)")
        end = [self.end_of_turn] if record.finish_reason == "stop" else []
        if not thinking:
            if record.reasoning_content or record.reasoning_closed:
                field = "reasoning_content" if record.reasoning_content else "reasoning_closed"
                raise InputError(
                    f"{record.where}: field '{field}': the record has reasoning, but the generation prompt "
                    "does not open a think block (check chat_template_kwargs)"
                )
            return self.text(record.content) + end
        closed = bool(record.content) if record.reasoning_closed is None else record.reasoning_closed
        ids = self.text(record.reasoning_content)
        if closed:
            ids += [self.think_end] + self.text(record.content)
        return ids + end
