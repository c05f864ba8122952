"""Token frequencies and the draft vocabulary (docs/TOKENIZATION.md, "Draft vocabulary").

d2t is an OFFSET table: target_id = i + d2t[i] (what vLLM, SGLang, speculators and EAGLE use);
t2d is a bool mask over the target vocabulary with exactly N true entries.
"""

import logging

import torch

from eaglenest.data.samples import read_tokenized
from eaglenest.data.target import target_config
from eaglenest.workflow.atomic import save_torch, write_json

log = logging.getLogger(__name__)


def count_tokens(samples, vocab_size):
    """int64 [vocab_size]: how often each token occurs where loss_mask == 1."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for sample in samples:
        ids = torch.tensor(sample["input_ids"], dtype=torch.int64)
        mask = torch.tensor(sample["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def select_draft_vocab(counts, draft_vocab_size):
    """Ascending target ids of the top-N tokens by count, ties to the lower id.

    Unseen ids (count 0) sort after every seen one, lowest first: that is the padding rule.
    """
    if not 0 < draft_vocab_size <= len(counts):
        raise ValueError(f"draft_vocab_size must be in [1, {len(counts)}], got {draft_vocab_size}")
    order = torch.argsort(-counts, stable=True)
    return torch.sort(order[:draft_vocab_size]).values


def draft_maps(selected, vocab_size):
    """(d2t int64 [N] offsets, t2d bool [V]) for ascending selected target ids."""
    d2t = selected - torch.arange(len(selected), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def token_freq(tokenized_path, target_dir, out_path):
    """tokenized_data.jsonl → token_freq.pt."""
    counts = count_tokens(read_tokenized(tokenized_path), target_config(target_dir)["vocab_size"])
    save_torch(out_path, counts)
    log.info("counted %d generated tokens, %d distinct", counts.sum(), (counts > 0).sum())


def vocab_map(freq_path, d2t_path, t2d_path, coverage_path, *, draft_vocab_size):
    """token_freq.pt → d2t.pt, t2d.pt and coverage.json."""
    counts = torch.load(freq_path)
    selected = select_draft_vocab(counts, draft_vocab_size)
    d2t, t2d = draft_maps(selected, len(counts))
    covered, generated = int(counts[selected].sum()), int(counts.sum())
    coverage = {
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": len(counts),
        "distinct_generated_tokens": int((counts > 0).sum()),
        "generated_tokens": generated,
        "covered_tokens": covered,
        "coverage": covered / max(generated, 1),
    }
    save_torch(d2t_path, d2t)
    save_torch(t2d_path, t2d)
    write_json(coverage_path, coverage)
    log.info("draft vocab: %s", coverage)
    return coverage


def load_vocab(d2t_path, t2d_path):
    """d2t (int64 offsets [N]) and t2d (bool [V]) saved with torch.save; checks they agree."""
    d2t = torch.load(d2t_path, weights_only=True).to(torch.int64)
    t2d = torch.load(t2d_path, weights_only=True).to(torch.bool)
    if not torch.equal(torch.arange(len(d2t)) + d2t, t2d.nonzero().flatten()):
        raise ValueError("d2t and t2d disagree: target id i + d2t[i] must list t2d's ids in order")
    return d2t, t2d
