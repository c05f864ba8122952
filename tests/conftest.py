"""Shared fixtures: a real demo target (tokenizer + tiny Llama), built once per test session."""

import pytest

from eaglenest.demo_target import build_demo_target

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
DEMO_CORPUS = REPO / "resources" / "demo" / "corpus.jsonl"
DEMO_RAW = REPO / "resources" / "demo" / "raw_responses.jsonl"


@pytest.fixture(scope="session")
def demo_target(tmp_path_factory):
    """The demo target with the default geometry, briefly trained (enough for states to be real)."""
    out = tmp_path_factory.mktemp("target") / "target"
    build_demo_target(DEMO_CORPUS, out, seed=0, steps=10, batch_size=8, seq_len=128)
    return out
