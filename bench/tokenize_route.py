"""Benchmark: what the plain-text route costs against the tokenizer's own encode (issue 12).

On the Kimi-style remote-code tiktoken tokenizer that the tests build (tests/kimi_tokenizer.py),
side by side on the same texts, alternating REPEATS times so that both columns see the same
machine:
  own encode   the tokenizer's `encode(text, add_special_tokens=False)`: what a naive stage
               calls, and what parses typed special tokens
  plain route  eaglenest's `Tokenizer.text` (the tiktoken Encoding, special tokens disallowed)
The texts are the demo corpus's messages, joined into long responses (about 2,000 tokens each,
the size of a Kimi-K2.5 sample). Prints a Markdown table of tokens/s and the ratio, and what
10,000 such samples (21 M tokens) take on one core at the plain route's rate.

    .venv/bin/python bench/tokenize_route.py
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from eaglenest.data.tokenizer import Tokenizer  # noqa: E402
from kimi_tokenizer import build_kimi_tokenizer, corpus_texts  # noqa: E402

REPEATS = 5
KIMI_TOKENS = 21_000_000  # 10,000 samples of ~2,100 tokens


def long_texts(tokenizer, tokens_each=2000, count=20):
    """`count` texts of about `tokens_each` tokens, made of the demo corpus's texts."""
    pool, texts, text = list(corpus_texts()), [], ""
    for piece in pool * 50:
        text += piece + "\n"
        if len(tokenizer.text(text)) >= tokens_each:
            texts.append(text)
            text = ""
            if len(texts) == count:
                return texts
    raise RuntimeError("the corpus is too small for the texts asked for")


def rate(encode, texts):
    """Tokens per second of `encode` over `texts`."""
    start = time.perf_counter()
    tokens = sum(len(encode(text)) for text in texts)
    return tokens / (time.perf_counter() - start)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        target = build_kimi_tokenizer(Path(tmp) / "kimi")
        tokenizer = Tokenizer(target, trust_remote_code=True, think_start="<think>", think_end="</think>",
                              end_of_turn="<|im_end|>", chat_template_kwargs={"thinking": True})
        texts = long_texts(tokenizer)
        own, plain = [], []
        for _ in range(REPEATS):
            own.append(rate(lambda t: tokenizer.hf.encode(t, add_special_tokens=False), texts))
            plain.append(rate(tokenizer.text, texts))
    own_rate, plain_rate = statistics.median(own), statistics.median(plain)
    tokens = sum(len(tokenizer.text(t)) for t in texts)
    print(f"{len(texts)} texts, {tokens} tokens, median of {REPEATS} alternating runs, one process\n")
    print("| route | tokens/s | ratio to own encode |")
    print("|---|---|---|")
    print(f"| own encode (parses typed special tokens) | {own_rate:,.0f} | 1.00 |")
    print(f"| plain route (`Tokenizer.text`) | {plain_rate:,.0f} | {plain_rate / own_rate:.2f} |")
    print(f"\n21 M tokens at the plain route's rate: {KIMI_TOKENS / plain_rate / 60:.1f} min on one core")


if __name__ == "__main__":
    main()
