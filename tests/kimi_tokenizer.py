"""Kimi-K2.5's kind of remote-code tokenizer (eaglenest.demo.kimi_tokenizer, docs/KIMI.md,
"Tokenizer") as the tests build it: learned from the first 400 demo chats, with a
config.json that sizes a target's vocabulary to it, and optionally a variant with no way to
encode plain text, to hold eaglenest's Tokenizer against.
"""

import itertools
import json
from pathlib import Path

import pytest

from eaglenest.demo.kimi_tokenizer import IM_TOKENS, chat_texts, write_kimi_tokenizer  # noqa: F401 (IM_TOKENS: for tests)
from eaglenest.workflow.jsonl import read_objects

CORPUS = Path(__file__).resolve().parents[1] / "resources" / "demo" / "corpus.jsonl"

# Appended to tokenization_kimi.py for tokenizer_class "SealedTikTokenTokenizer".
SEALED = r'''

class SealedTikTokenTokenizer(TikTokenTokenizer):
    """The same vocabulary with no plain-text path: special tokens are parsed on every path, and
    the Encoding sits in a tuple, so that no attribute of the instance is one."""

    model = property(lambda self: self._sealed[0], lambda self, encoding: setattr(self, "_sealed", (encoding,)))

    def encode(self, text, allow_special_tokens=True, **kwargs):
        return super().encode(text, True, **kwargs)
'''


def build_kimi_tokenizer(out_dir, *, merges=256, tokenizer_class="TikTokenTokenizer"):
    """Write the tokenizer (and a config.json with its vocab_size) into `out_dir`; return the dir.

    tokenizer_class: "TikTokenTokenizer" (Kimi's kind) or "SealedTikTokenTokenizer" (no way to
    encode plain text)."""
    out_dir = Path(out_dir)
    vocab_size = write_kimi_tokenizer(out_dir, chat_texts(itertools.islice(read_objects(CORPUS), 400)), merges=merges)
    if tokenizer_class == "SealedTikTokenTokenizer":
        with open(out_dir / "tokenization_kimi.py", "a") as f:
            f.write(SEALED)
        config = json.loads((out_dir / "tokenizer_config.json").read_text())
        config |= {"tokenizer_class": tokenizer_class,
                   "auto_map": {"AutoTokenizer": [f"tokenization_kimi.{tokenizer_class}", None]}}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps({"vocab_size": vocab_size}, indent=2) + "\n")
    return out_dir


@pytest.fixture(scope="session")
def kimi_tokenizer_dir(tmp_path_factory):
    """A target directory holding a Kimi-style tokenizer (and the config.json a target has); a
    whole Kimi-packaged target: tests/kimi_target.py."""
    return build_kimi_tokenizer(tmp_path_factory.mktemp("kimi") / "target")
