"""Artifacts rebuilt from the same inputs have the same bytes: Snakemake checksums small files,
so bytes that vary with nothing changed would rerun downstream stages for nothing."""

import torch

from eaglenest.data.tokenize import tokenize_file
from eaglenest.data.vocab import token_freq, vocab_map
from eaglenest.workflow.atomic import save_torch

from conftest import DEMO_RAW

TOKENIZE = dict(
    trust_remote_code=False, max_seq_len=512, overlong="truncate", chat_template_kwargs={"thinking": True},
    think_start="<think>", think_end="</think>", end_of_turn="<|im_end|>",
)


def test_save_torch_bytes_depend_on_the_object_only(tmp_path):
    obj = {"counts": torch.arange(7), "mask": torch.tensor([True, False]), "step": 3}
    paths = [tmp_path / "a.pt", tmp_path / "sub" / "other_name.pt", tmp_path / "a.pt"]
    written = []
    for path in paths:  # the last one overwrites the first
        save_torch(path, obj)
        written.append(path.read_bytes())
    assert written[0] == written[1] == written[2]
    loaded = torch.load(paths[1], weights_only=True)
    assert loaded.keys() == obj.keys() and loaded["step"] == 3
    assert torch.equal(loaded["counts"], obj["counts"]) and torch.equal(loaded["mask"], obj["mask"])


def build_vocab(demo_target, out):
    """The tokenize, token_freq and vocab_map stages from the demo's raw responses into `out`."""
    tokenized = out / "tokenized_data.jsonl"
    tokenize_file(DEMO_RAW, demo_target, tokenized, out / "tokenize_report.json", **TOKENIZE)
    token_freq(tokenized, demo_target, out / "token_freq.pt")
    vocab_map(out / "token_freq.pt", out / "d2t.pt", out / "t2d.pt", out / "coverage.json", draft_vocab_size=128)


def test_rebuilt_vocab_stages_write_the_same_bytes(demo_target, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_vocab(demo_target, a)
    build_vocab(demo_target, b)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"token_freq.pt", "d2t.pt", "t2d.pt"} <= set(names)
    assert [n for n in names if (a / n).read_bytes() != (b / n).read_bytes()] == []
