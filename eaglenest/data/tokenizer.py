"""The target's tokenizer as the workflow uses it: faithful prompt rendering and the special ids.

Its own module because two stages use it: generate (what the target is asked) and tokenize
(the stream it is trained on); editing how records are read concerns only the latter.
What the stream must be: docs/CONVENTIONS.md, "Token stream".
"""

import re

from eaglenest.workflow.errors import InputError

# Private-use characters mark where message contents sit in the rendered template.
_SLOT = re.compile("\ue000(\\d+)\ue001")


class Tokenizer:
    """The target's HF tokenizer plus the ids of the tokens the stream is built from."""

    def __init__(self, target_dir, *, think_start, think_end, end_of_turn, chat_template_kwargs):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(target_dir)
        self.template_kwargs = dict(chat_template_kwargs)
        self.think_start = self.special_id(think_start)
        self.think_end = self.special_id(think_end)
        self.end_of_turn = self.special_id(end_of_turn)

    def special_id(self, token):
        ids = self.hf.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise InputError(f"tokenizer: {token!r} is not a single special token (encodes to {ids})")
        return ids[0]

    def text(self, text):
        """Encode text that must never produce special tokens."""
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def template(self, text):
        """Encode template text, whose special tokens are real."""
        return self.hf.encode(text, add_special_tokens=False)

    def prompt(self, messages):
        """Render the prompt with the generation prompt; message contents are encoded as plain text."""
        slotted = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self.hf.apply_chat_template(
            slotted, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        parts = _SLOT.split(rendered)
        ids = self.template(parts[0])
        for slot, template_text in zip(parts[1::2], parts[2::2]):
            ids += self.text(messages[int(slot)]["content"]) + self.template(template_text)
        return ids

    def generated(self, record, thinking):
        """The tokens the model emitted for this record (see module docstring)."""
        if not thinking:
            if record.reasoning_content:
                raise InputError(
                    f"{record.where}: field 'reasoning_content': non-empty, but the generation prompt "
                    "does not open a think block (check chat_template_kwargs)"
                )
            return self.text(record.content) + ([self.end_of_turn] if record.finish_reason == "stop" else [])
        ids = self.text(record.reasoning_content)
        if record.finish_reason == "length" and not record.content:
            return ids
        ids += [self.think_end] + self.text(record.content)
        return ids + ([self.end_of_turn] if record.finish_reason == "stop" else [])
