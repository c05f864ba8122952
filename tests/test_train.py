"""Training, offline evaluation and init_from on shards of a real (tiny, random) Llama target."""

import csv
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglenest.atomic import save_torch
from eaglenest.drafter import Drafter
from eaglenest.evaluate import evaluate_offline
from eaglenest.export import load_drafter, read_checkpoint, write_drafter
from eaglenest.hidden_states import extract_shard, write_manifest
from eaglenest.shards import read_shard, write_shard
from eaglenest.train import TargetHead, is_heldout, train_drafter
from eaglenest.vocab import count_tokens, draft_maps, select_draft_vocab

V, N, PROMPT, NEW, K = 256, 64, 8, 40, 3
HELDOUT = 0.2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A random 8-layer Llama (the demo geometry), 48 greedy continuations of random prompts
    (loss_mask on the generated part), their hidden states in 2 shards, a 64-token draft vocab."""
    root = tmp_path_factory.mktemp("data")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
        initializer_range=0.06, tie_word_embeddings=False,
    )  # init 0.06: greedy output repeats a little, a learnable but not trivial stream
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "target")
    ids = torch.randint(0, V, (48, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    samples = [
        {"id": f"s{i}", "input_ids": row.tolist(), "loss_mask": [0] * PROMPT + [1] * NEW}
        for i, row in enumerate(ids)
    ]
    shards = [root / "shard_0.safetensors", root / "shard_1.safetensors"]
    for shard, part in zip(shards, (samples[:24], samples[24:])):
        extract_shard(root / "target", part, shard, aux_layer_ids=None, dtype="float32", device="cpu")
    write_manifest(shards, root / "target", root / "manifest.json", aux_layer_ids=None, dtype="float32")
    d2t, t2d = draft_maps(select_draft_vocab(count_tokens(samples, V), N), V)
    save_torch(root / "d2t.pt", d2t)
    save_torch(root / "t2d.pt", t2d)
    return root, shards


def train(root, shards, name, **kwargs):
    args = dict(seed=0, ttt_steps=K, max_steps=100, batch_size=8, lr=3e-3, warmup=5,
                heldout_fraction=HELDOUT, log_every=10)
    args.update(kwargs)
    out = root / name
    train_drafter(shards, root / "manifest.json", args.pop("d2t", root / "d2t.pt"), root / "t2d.pt",
                  root / "target", out, root / f"{name}.tsv", **args)
    return out


@pytest.fixture(scope="module")
def trained(data):
    root, shards = data
    return train(root, shards, "trained")


def test_target_head_reproduces_the_greedy_data(data):
    """Stored final states (pre-norm) + the target's norm and lm_head give its argmax = the
    next greedy token, wherever that token is in the draft vocab."""
    root, shards = data
    head = TargetHead(root / "target")
    t2d = torch.load(root / "t2d.pt")
    draft_ids = t2d.nonzero().flatten()
    for sample in read_shard(shards[0]):
        probs, in_vocab = head.distribution(sample["final_hidden_states"][None], t2d)
        nxt = sample["input_ids"][1:]
        keep = in_vocab[0, :-1] & sample["loss_mask"][1:]
        assert keep.any()
        assert torch.equal(draft_ids[probs[0, :-1].argmax(-1)][keep], nxt[keep])
        assert torch.equal(in_vocab[0, :-1][sample["loss_mask"][1:]], t2d[nxt][sample["loss_mask"][1:]])


def test_heldout_split_is_stable_under_appending():
    ids = [f"sample-{i}" for i in range(2000)]
    split = {i: is_heldout(i, 0.1) for i in ids}
    assert 120 < sum(split.values()) < 280
    more = ids + [f"new-{i}" for i in range(500)]
    assert all(is_heldout(i, 0.1) == split[i] for i in more[:2000])
    assert not any(is_heldout(i, 0.0) for i in ids) and all(is_heldout(i, 1.0) for i in ids)


def test_training_lowers_loss_raises_accuracy_and_is_deterministic(data, trained):
    root, shards = data
    with open(root / "trained.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    first, last = rows[0], rows[-1]
    assert int(last["step"]) == 100
    assert float(last["loss"]) < float(first["loss"]) - 0.3
    for k in range(K):
        assert float(last[f"acc_{k}"]) > float(first[f"acc_{k}"]) + 0.2

    again = train(root, shards, "again")
    assert (again / "model.safetensors").read_bytes() == (trained / "model.safetensors").read_bytes()
    assert (again / "config.json").read_text() == (trained / "config.json").read_text()


def reference_lengths(ids, mask, predictions, K):
    """Plain loop: {anchor t: accepted length} for the anchors where x_{t+1} and x_{t+2} are
    generated; depth k accepted while predictions[k][t] == x_{t+k+2}, a generated token."""
    lengths = {}
    for t in range(len(ids) - 2):
        if mask[t + 1] and mask[t + 2]:
            a = 0
            while a < K and t + a + 2 < len(ids) and mask[t + a + 2] and predictions[a][t] == ids[t + a + 2]:
                a += 1
            lengths[t] = a
    return lengths


def reference_served(lengths):
    """The anchors vLLM drafts from: the first one, then t + accepted + 1 while it is an anchor."""
    out, t = [], min(lengths)
    while t in lengths:
        out.append(lengths[t])
        t += lengths[t] + 1
    return out


def test_offline_eval_of_trained_drafter(data, trained):
    root, shards = data
    metrics = evaluate_offline(shards, root / "manifest.json", trained, root / "target",
                               root / "eval.json", heldout_fraction=HELDOUT, num_speculative_tokens=K)
    assert json.loads((root / "eval.json").read_text()) == metrics

    drafter = load_drafter(trained)
    every, served, samples = [], [], 0
    for shard in shards:
        for s in read_shard(shard):
            if not is_heldout(s["id"], HELDOUT):
                continue
            samples += 1
            with torch.no_grad():
                logits = drafter(s["input_ids"][None], s["aux_hidden_states"][None].float(), K)
            predictions = [drafter.draft_to_target(lg[0].argmax(-1)).tolist() for lg in logits]
            lengths = reference_lengths(s["input_ids"].tolist(), s["loss_mask"].tolist(), predictions, K)
            every += lengths.values()
            served += reference_served(lengths)
    assert metrics["heldout_samples"] == samples > 0
    for result, lengths in ((metrics, every), (metrics["served"], served)):
        assert result["num_drafts"] == len(lengths) and result["num_draft_tokens"] == K * len(lengths)
        assert result["num_accepted_tokens_per_position"] == [sum(a > k for a in lengths) for k in range(K)]
        rates = result["acceptance_rate_per_position"]
        assert all(a >= b for a, b in zip(rates, rates[1:]))
        assert 1 <= result["mean_acceptance_length"] <= K + 1

    untrained = train(root, shards, "untrained", max_steps=0)
    before = evaluate_offline(shards, root / "manifest.json", untrained, root / "target",
                              root / "eval0.json", heldout_fraction=HELDOUT, num_speculative_tokens=K)
    assert metrics["mean_acceptance_length"] > before["mean_acceptance_length"] + 0.2


def test_offline_eval_oracle_counts(data, tmp_path):
    """A drafter that always drafts token c (lm_head = 0: draft id 0) on a hand-made sample:
    ids [5, 6, c, c, c, 7, c, c], generated from index 2. Drafts at anchors 1..5 (x_{t+1}, x_{t+2}
    generated); accepted: t=1 c,c,7 -> 2; t=2 c,7 -> 1; t=3 7 -> 0; t=4 c,c,end -> 2; t=5 c,end -> 1.
    Served, vLLM drafts at t=1 (2 accepted), then at t=4 (2 accepted), then the sample ends."""
    root, _ = data
    config, state = read_checkpoint(root / "trained")
    drafter = Drafter(config)
    drafter.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in state.items()})
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
    c = int(drafter.draft_to_target(torch.tensor(0)))
    assert c not in (5, 6, 7)
    (tmp_path / "d").mkdir()
    write_drafter(drafter, tmp_path / "d", verifier_name_or_path="t", verifier_architectures=[],
                  speculative_tokens=K)
    ids = torch.tensor([5, 6, c, c, c, 7, c, c])
    sample = {
        "id": "oracle", "input_ids": ids, "loss_mask": torch.tensor([0, 0, 1, 1, 1, 1, 1, 1]).bool(),
        "aux_hidden_states": torch.randn(8, 3 * 128), "final_hidden_states": torch.randn(8, 128),
    }
    write_shard(tmp_path / "oracle.safetensors", [sample], hidden_size=128, dtype=torch.float32)
    metrics = evaluate_offline([tmp_path / "oracle.safetensors"], root / "manifest.json", tmp_path / "d",
                               root / "target", tmp_path / "eval.json", heldout_fraction=1.0,
                               num_speculative_tokens=K)
    assert metrics["num_drafts"] == 5
    assert metrics["num_accepted_tokens_per_position"] == [4, 2, 0]
    assert metrics["acceptance_rate_per_position"] == [0.8, 0.4, 0.0]
    assert metrics["mean_acceptance_length"] == pytest.approx(2.2)
    assert metrics["num_accepted_tokens"] == 6 and metrics["num_draft_tokens"] == 15
    assert metrics["served"]["num_drafts"] == 2
    assert metrics["served"]["num_accepted_tokens_per_position"] == [2, 2, 0]
    assert metrics["served"]["mean_acceptance_length"] == 3.0


def test_init_from_maps_lm_head_rows_by_target_id(data, trained):
    """A new draft vocab (half shared with the trained one): shared ids keep the trained rows,
    new ids get the target's lm_head rows; every other weight is copied."""
    root, shards = data
    old_ids = torch.arange(N) + torch.load(root / "d2t.pt")
    unused = torch.tensor([i for i in range(V) if i not in set(old_ids.tolist())])
    new_ids = torch.cat([old_ids[::2], unused[: N // 2]]).sort().values
    d2t, t2d = draft_maps(new_ids, V)
    save_torch(root / "d2t_new.pt", d2t)
    save_torch(root / "t2d_new.pt", t2d)
    out = root / "init"
    train_drafter(shards, root / "manifest.json", root / "d2t_new.pt", root / "t2d_new.pt",
                  root / "target", out, root / "init.tsv", seed=1, ttt_steps=K, max_steps=0,
                  init_from=trained)

    old, new = load_drafter(trained), load_drafter(out)
    target_lm_head = TargetHead(root / "target").lm_head  # float32 target: exported as float32
    old_row = {int(i): r for i, r in zip(old_ids, old.lm_head.weight)}
    for i, row in zip(new_ids.tolist(), new.lm_head.weight):
        assert torch.equal(row, old_row[i] if i in old_row else target_lm_head[i]), i
    assert sum(i in old_row for i in new_ids.tolist()) == N // 2
    for name, tensor in old.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(new.state_dict()[name], tensor), name
    assert torch.equal(new.d2t, d2t) and torch.equal(new.t2d, t2d)
