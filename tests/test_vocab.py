"""token_freq and the draft vocabulary, as docs/TOKENIZATION.md ("Draft vocabulary") defines them."""

import json

import torch

from eaglenest.data.vocab import count_tokens, draft_maps, select_draft_vocab, vocab_map


def test_counts_only_generated_tokens():
    samples = [{"input_ids": [1, 2, 3, 3], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [1, 4], "loss_mask": [1, 0]}]
    assert count_tokens(samples, 6).tolist() == [0, 1, 1, 2, 0, 0]


def test_top_n_ties_to_lower_id_then_sorted():
    counts = torch.tensor([0, 5, 3, 5, 3, 9, 1])
    assert select_draft_vocab(counts, 4).tolist() == [1, 2, 3, 5]  # 9, 5, 5, then 3 at id 2 beats id 4


def test_pads_with_lowest_unused_ids_when_few_tokens_were_seen():
    counts = torch.tensor([0, 0, 7, 0, 2, 0])
    assert select_draft_vocab(counts, 4).tolist() == [0, 1, 2, 4]


def test_d2t_is_an_offset_and_t2d_a_mask():
    selected = torch.tensor([0, 1, 2, 4, 9])
    d2t, t2d = draft_maps(selected, 12)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 0, 0, 1, 5]
    assert torch.equal(torch.arange(5) + d2t, selected)
    assert t2d.dtype == torch.bool and int(t2d.sum()) == 5
    assert torch.equal(t2d.nonzero().flatten(), selected)


def test_vocab_map_files_and_coverage(tmp_path):
    counts = torch.tensor([0, 10, 30, 0, 60])
    torch.save(counts, tmp_path / "freq.pt")
    out = [tmp_path / n for n in ("d2t.pt", "t2d.pt", "coverage.json")]
    vocab_map(tmp_path / "freq.pt", *out, draft_vocab_size=2)
    assert (torch.arange(2) + torch.load(out[0])).tolist() == [2, 4]
    assert torch.load(out[1]).nonzero().flatten().tolist() == [2, 4]
    coverage = json.loads(out[2].read_text())
    assert coverage["coverage"] == 0.9 and coverage["generated_tokens"] == 100
