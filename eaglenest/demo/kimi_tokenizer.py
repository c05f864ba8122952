"""A remote-code tokenizer of Kimi-K2.5's kind (docs/KIMI.md, "Tokenizer"), for
the Kimi-shaped demo target (eaglenest.demo.kimi) and the tests that hold eaglenest's Tokenizer
against the tokenizer the real target uses.

Everything is our own: a small tiktoken BPE (the 256 bytes plus merges learned greedily from
chat texts), 256 reserved special ids right after the base vocabulary with Kimi's names at
Kimi's offsets, and a `tokenization_kimi.py` whose `encode` has the semantics of Kimi's: with no
extra keyword arguments it parses special tokens; with any it hands over to
`PreTrainedTokenizer.encode`, whose `_tokenize` calls that same `encode`, so
`split_special_tokens=True` still parses them. Only `encode(text, allow_special_tokens=False)`
keeps special-token text as text.

Only workflow-independent code is imported, as in eaglenest.demo.target: editing a later stage
never changes the demo target.
"""

import base64
import json
from collections import Counter
from pathlib import Path

import regex

from eaglenest.demo.target import CHAT_TEMPLATE

# Our own split pattern, in the manner of tiktoken's: letters, 1-3 digits, punctuation, spaces.
PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

RESERVED = 256  # special ids after the base vocabulary
# Offsets after the base vocabulary, as in Kimi-K2.5 (base 163,584: <|im_end|> is 163,586).
# Kimi's tool-call tokens sit at 11 to 15 (163,595 to 163,599).
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
         11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
         14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
         17: "<|im_middle|>", 21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]"}
MEDIA_PAD = 21  # the offset of <|media_pad|>, which Kimi's config.json names media_placeholder_token_id
IM_TOKENS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<think>", "</think>"]
# Kimi's tool-call tokens, as tokenize.tool_call_tokens names them (eaglenest.data.tokenizer.TOOL_CALL_TOKENS)
TOOL_CALL_TOKENS = {"section_begin": "<|tool_calls_section_begin|>", "call_begin": "<|tool_call_begin|>",
                    "argument_begin": "<|tool_call_argument_begin|>", "call_end": "<|tool_call_end|>",
                    "section_end": "<|tool_calls_section_end|>"}

TOKENIZATION_KIMI = r'''"""A Kimi-style tiktoken tokenizer (written by eaglenest.demo.kimi_tokenizer).

encode() behaves as Kimi's: with no extra keyword arguments it parses special-token text into
special ids; with any it hands over to PreTrainedTokenizer.encode, whose _tokenize calls encode()
again. Plain text is encode(text, allow_special_tokens=False).
"""

import base64
from pathlib import Path

import tiktoken
from transformers import PreTrainedTokenizer

PATTERN = PATTERN_HERE


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = 256

    def __init__(self, vocab_file, added_tokens_decoder=None, **kwargs):
        ranks = {}
        for line in Path(vocab_file).read_text().splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        base = len(ranks)
        names = {i: t.content for i, t in (added_tokens_decoder or {}).items()}
        special = {names.get(i, f"<|reserved_token_{i - base}|>"): i
                   for i in range(base, base + self.num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name="kimi-like", pat_str=PATTERN, mergeable_ranks=ranks,
                                       special_tokens=special)
        # Token strings for the PreTrainedTokenizer machinery: bytes as latin-1, specials by name.
        self.decoder = {i: token.decode("latin-1") for token, i in ranks.items()}
        self.decoder.update({i: name for name, i in special.items()})
        self.encoder = {name: i for i, name in self.decoder.items()}
        super().__init__(added_tokens_decoder=added_tokens_decoder or {}, **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def encode(self, text, allow_special_tokens=True, **kwargs):
        if kwargs:
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all", disallowed_special=())
        return self.model.encode(text, disallowed_special=())

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens):
        return self.model.decode([self.encoder[t] for t in tokens])

    def decode(self, token_ids, **kwargs):
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))
'''


def chat_texts(records):
    """The texts of chat records (canonical records, docs/CONTRACTS.md): what the BPE learns from."""
    for record in records:
        yield from (m["content"] for m in record["messages"])
        yield from (record["reasoning_content"], record["content"])


def learn_ranks(texts, merges):
    """tiktoken ranks: the 256 bytes, then `merges` greedy BPE merges (the most frequent adjacent
    pair first, ties to the larger pair, so that the result is deterministic)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([b]) for b in piece.encode()) for text in texts for piece in regex.findall(PATTERN, text))
    for _ in range(merges):
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        ranks.setdefault(best[0] + best[1], len(ranks))
        words = Counter({_merge(word, best): count for word, count in words.items()})
    return ranks


def _merge(word, pair):
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def write_kimi_tokenizer(out_dir, texts, *, merges, model_max_length=4096):
    """Write the tokenizer learned from `texts` into `out_dir` (tiktoken.model,
    tokenization_kimi.py, tokenizer_config.json); return its vocabulary size (the base
    vocabulary and the reserved special ids), which the model's embedding must hold."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = learn_ranks(texts, merges)
    base = len(ranks)
    (out_dir / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    (out_dir / "tokenization_kimi.py").write_text(TOKENIZATION_KIMI.replace("PATTERN_HERE", repr(PATTERN)))
    added = {str(base + offset): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
             for offset, name in sorted(NAMED.items())}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": added,
        "additional_special_tokens": IM_TOKENS + list(TOOL_CALL_TOKENS.values()),
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return base + RESERVED
