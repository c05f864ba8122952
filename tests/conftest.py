"""Shared fixtures: a real demo target (tokenizer + tiny Llama), built once per test session."""

import pytest
import torch

from eaglenest.demo_target import build_demo_target

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
DEMO_CORPUS = REPO / "resources" / "demo" / "corpus.jsonl"
DEMO_RAW = REPO / "resources" / "demo" / "raw_responses.jsonl"


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run fastest on one torch thread, and stay fast on a busy machine (two OpenMP
    threads on two busy cores measured 15-25x slower per step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_target(tmp_path_factory):
    """The demo target with the default geometry, briefly trained (enough for states to be real)."""
    out = tmp_path_factory.mktemp("target") / "target"
    build_demo_target(DEMO_CORPUS, out, seed=0, steps=10, batch_size=8, seq_len=128)
    return out
