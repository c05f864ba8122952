"""The target's head and embedding in the target's own dtype: no float32 copy of anything vocab-sized,
one frozen embedding shared by the head and the drafter, bf16 training and evaluation paths, argmax
ties, and the chunked drafting of the offline evaluations; on real tiny Llama targets stored in bf16."""

import inspect
import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from eaglenest.data.target import read_target_embedding
from eaglenest.data.vocab import count_tokens, draft_maps, select_draft_vocab
from eaglenest.drafter.export import write_drafter
from eaglenest.drafter.load import as_served, load_drafter, load_drafter_copy
from eaglenest.drafter.model import Drafter, DrafterConfig, cached_attend, ttt_attention
from eaglenest.evaluate.acceptance import acceptance, accepted_lengths, chain_drafts, served_anchors, served_positions
from eaglenest.evaluate.agreement import misreadings, offline_estimates, tolerance, trained_drafter
from eaglenest.evaluate.agreement_states import AgreementStates, extract_agreement_states
from eaglenest.evaluate.expected import ceiling_outcomes, estimate, sample_counts, sample_seed
from eaglenest.states.hf import extract_shard
from eaglenest.states.manifest import write_manifest
from eaglenest.states.shards import collate, read_shard
from eaglenest.train.init_drafter import new_drafter
from eaglenest.train.loop import start_run, train_drafter
from eaglenest.train.loss import ttt_loss
from eaglenest.drafter.target_head import TargetHead
from eaglenest.workflow.atomic import save_torch

V, N, H, K = 128, 96, 64, 3
AUX = [1, 2, 3]


def build_target(path, dtype, edit=None):
    """A random 4-layer Llama with bf16-exact weights, saved in `dtype`; `edit(model)` changes it first."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, initializer_range=0.06,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    model.to(dtype).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The same target stored in float32 and in bf16, a bf16 shard of 8 random samples taken from
    the bf16 one, its manifest and a 96-token draft vocab."""
    root = tmp_path_factory.mktemp("head")
    targets = {dtype: build_target(root / str(dtype).removeprefix("torch."), dtype)
               for dtype in (torch.float32, torch.bfloat16)}
    ids = torch.randint(0, V, (8, 32), generator=torch.Generator().manual_seed(0))
    samples = [{"id": f"s{i}", "input_ids": row.tolist(), "loss_mask": [0] * 4 + [1] * 28} for i, row in enumerate(ids)]
    shard = root / "shard_0.safetensors"
    extract_shard(targets[torch.bfloat16], samples, shard, aux_layer_ids=AUX, dtype="bfloat16", device="cpu",
                  trust_remote_code=False)
    manifest = write_manifest([shard], targets[torch.bfloat16], root / "manifest.json", aux_layer_ids=AUX,
                              dtype="bfloat16")
    d2t, t2d = draft_maps(select_draft_vocab(count_tokens(samples, V), N), V)
    save_torch(root / "d2t.pt", d2t)
    save_torch(root / "t2d.pt", t2d)
    return {"root": root, "targets": targets, "shard": shard, "manifest": manifest, "d2t": d2t, "t2d": t2d}


def float_batch(data):
    """The shard's samples as one batch, its states float32 as training takes them (bf16 stored)."""
    batch = collate(read_shard(data["shard"]))
    return {key: t.float() if t.is_floating_point() else t for key, t in batch.items()}


def head_and_drafter(data, dtype):
    head = TargetHead(data["targets"][dtype])
    return head, new_drafter(data["targets"][dtype], data["manifest"], data["d2t"], data["t2d"], head, seed=0)


@pytest.fixture(scope="module")
def trained(data):
    """A drafter trained 2 steps on the bf16 target (and the DrafterConfig it was trained with, beside it)."""
    root = data["root"]
    train_drafter([data["shard"]], root / "manifest.json", root / "d2t.pt", root / "t2d.pt",
                  data["targets"][torch.bfloat16], root / "drafter", root / "log.tsv", seed=0, ttt_steps=K,
                  max_steps=2, device="cpu", trained_config_path=root / "drafter_config.json")
    return root / "drafter"


def held_tensors(head):
    """Every tensor a TargetHead holds: its tensor attributes and its modules' parameters and buffers."""
    found = []
    for value in vars(head).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, torch.nn.Module):
            found += [*value.parameters(), *value.buffers()]
    return found


def test_a_bf16_target_head_holds_no_float32_vocab_tensor_and_shares_its_embedding(data):
    head, drafter = head_and_drafter(data, torch.bfloat16)
    tensors = held_tensors(head)
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    assert not [t.shape for t in tensors if t.dtype == torch.float32 and V in t.shape]
    weight = drafter.embed_tokens.weight
    assert weight.data_ptr() == head.embed_tokens.data_ptr()
    assert weight.dtype == torch.bfloat16 and not weight.requires_grad
    assert torch.equal(weight, read_target_embedding(data["targets"][torch.bfloat16]))


def test_bf16_and_float32_heads_give_the_same_distribution(data):
    """The same (bf16-exact) weights computed in bf16 or in float32: probabilities within bf16 rounding."""
    batch = float_batch(data)
    probs16, in_vocab16 = TargetHead(data["targets"][torch.bfloat16]).distribution(batch["final_hidden_states"],
                                                                                  data["t2d"], chunk_tokens=50)
    probs32, in_vocab32 = TargetHead(data["targets"][torch.float32]).distribution(batch["final_hidden_states"],
                                                                                 data["t2d"])
    assert probs16.dtype == torch.float32 and probs16.shape == probs32.shape == (8, 32, N)
    torch.testing.assert_close(probs16.sum(-1), torch.ones(8, 32))
    torch.testing.assert_close(probs16, probs32, atol=2e-3, rtol=0.05)
    assert (in_vocab16 == in_vocab32).float().mean() > 0.95


def test_argmax_ties_go_to_the_lowest_id_and_in_vocab_follows_it(tmp_path):
    """lm_head rows 5 and 9 all ones, hidden states all ones (norm: exactly ones in bf16): logits of
    5 and 9 are exactly 64, the largest. The target's argmax is 5, so in_vocab is whether 5 is a
    draft token (9 being one does not count); in the draft vocab the tie goes to 5 as well."""
    def tie(model):
        model.lm_head.weight[[5, 9]] = 1.0

    head = TargetHead(build_target(tmp_path / "tie", torch.bfloat16, edit=tie))
    final = torch.ones(1, 2, H)
    final[0, 1] = 3.0
    for draft_ids, want in (([9, 20], False), ([5, 20], True), ([5, 9, 20], True)):
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[draft_ids] = True
        probs, in_vocab = head.distribution(final, t2d)
        assert in_vocab.tolist() == [[want, want]], draft_ids
        if want:
            assert (probs.argmax(-1) == 0).all()  # draft id 0 is target id 5
        if draft_ids == [5, 9, 20]:
            assert torch.equal(probs[..., 0], probs[..., 1])  # 5 and 9: the same probability


def test_ttt_loss_under_cpu_bf16_autocast_with_a_bf16_head(data):
    """One forward + backward under CPU bf16 autocast, the head and the embedding bf16: the loss
    within 5% of the all-float32 one, every gradient finite, none for the frozen embedding. Without
    autocast the bf16 embedding also runs with the float32 layer."""
    batch = float_batch(data)
    head32, drafter32 = head_and_drafter(data, torch.float32)
    head16, drafter16 = head_and_drafter(data, torch.bfloat16)
    assert drafter32.embed_tokens.weight.dtype == torch.float32
    normalisers = [batch["loss_mask"][:, k + 2 :].sum().item() for k in range(K)]
    loss32 = ttt_loss(drafter32, batch, head32, drafter32.t2d, K, 0.8, normalisers)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16 = ttt_loss(drafter16, batch, head16, drafter16.t2d, K, 0.8, normalisers)[0]
    loss16.backward()
    assert torch.isfinite(loss16) and abs(loss16.item() - loss32.item()) <= 0.05 * loss32.item()
    learnt = [p for p in drafter16.parameters() if p.requires_grad]
    assert learnt and all(p.grad is not None and torch.isfinite(p.grad).all() for p in learnt)
    assert drafter16.embed_tokens.weight.grad is None
    with torch.no_grad():
        logits16 = drafter16(batch["input_ids"], batch["aux_hidden_states"], K)
        logits32 = drafter32(batch["input_ids"], batch["aux_hidden_states"], K)
    for a, b in zip(logits16, logits32):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0.02, rtol=0.02)


def test_training_shares_the_embedding_never_optimizes_it_and_exports_the_targets(data, trained):
    root, target = data["root"], data["targets"][torch.bfloat16]
    defaults = {name: p.default for name, p in inspect.signature(train_drafter).parameters.items()
                if p.default is not inspect.Parameter.empty}  # start_run's settings, as train_drafter defaults them
    settings = {name: defaults[name] for name in inspect.signature(start_run).parameters if name in defaults}
    settings.update(seed=0, ttt_steps=K, max_steps=2, device="cpu")
    run = start_run([data["shard"]], data["manifest"], root / "d2t.pt", root / "t2d.pt", target, False, **settings)
    weight = run.drafter.embed_tokens.weight
    assert weight.data_ptr() == run.head.embed_tokens.data_ptr() and weight.dtype == torch.bfloat16
    optimized = {p.data_ptr() for group in run.optimizer.param_groups for p in group["params"]}
    learnt = {p.data_ptr() for name, p in run.drafter.named_parameters() if name != "embed_tokens.weight"}
    assert optimized == learnt and weight.data_ptr() not in optimized

    with safe_open(str(trained / "model.safetensors"), framework="pt") as f:
        exported = {name: f.get_tensor(name) for name in f.keys()}
    assert set(exported) == set(Drafter(run.drafter.config).state_dict())
    assert {t.dtype for n, t in exported.items() if n not in ("d2t", "t2d")} == {torch.bfloat16}
    assert torch.equal(exported["embed_tokens.weight"], read_target_embedding(target))


def test_export_writes_what_a_float32_embedding_copy_wrote(data, tmp_path):
    """The drafter sharing the bf16 embedding exports the very bytes the one with a float32 copy
    (as training kept it before) exported."""
    _, shared = head_and_drafter(data, torch.bfloat16)
    copied = Drafter(shared.config)
    copied.load_state_dict(shared.state_dict())
    assert copied.embed_tokens.weight.dtype == torch.float32
    for name, drafter in (("shared", shared), ("copied", copied)):
        (tmp_path / name).mkdir()
        write_drafter(drafter, tmp_path / name, verifier_name_or_path="t", verifier_architectures=[],
                      speculative_tokens=K, dtype=torch.bfloat16)
    assert (tmp_path / "shared/config.json").read_text() == (tmp_path / "copied/config.json").read_text()
    assert (tmp_path / "shared/model.safetensors").read_bytes() == (tmp_path / "copied/model.safetensors").read_bytes()


def test_loaded_drafters_keep_the_embedding_in_its_dtype_and_copies_share_it(data, tmp_path):
    """load_drafter: float32 weights but the embedding, kept as stored (bf16) and frozen; the
    agreement check's misread copies share every weight but their own vocab maps."""
    _, drafter = head_and_drafter(data, torch.bfloat16)
    write_drafter(drafter, tmp_path, verifier_name_or_path="t", verifier_architectures=[], speculative_tokens=K,
                  dtype=torch.bfloat16)
    loaded = load_drafter(tmp_path)
    dtypes = {name: t.dtype for name, t in loaded.state_dict().items() if t.is_floating_point()}
    assert dtypes.pop("embed_tokens.weight") == torch.bfloat16 and set(dtypes.values()) == {torch.float32}
    assert not loaded.embed_tokens.weight.requires_grad and not any(t.is_meta for t in loaded.state_dict().values())
    assert torch.equal(loaded.embed_tokens.weight, read_target_embedding(data["targets"][torch.bfloat16]))
    flipped = load_drafter_copy(loaded, norm_before_residual=True)
    assert flipped.config.norm_before_residual
    assert flipped.embed_tokens.weight.data_ptr() == loaded.embed_tokens.weight.data_ptr()
    flipped.d2t.zero_()
    assert torch.equal(loaded.d2t, data["d2t"])


def test_chunked_attention_is_ttt_attention():
    """cached_attend over chunks of 4 anchors, a KV cache between them, gives ttt_attention's output at every step."""
    g = torch.Generator().manual_seed(0)
    B, T, heads, kv_heads, D = 2, 10, 4, 2, 8
    q = [torch.randn(B, T, heads, D, generator=g) for _ in range(K)]
    keys = [torch.randn(B, T, kv_heads, D, generator=g) for _ in range(K)]
    values = [torch.randn(B, T, kv_heads, D, generator=g) for _ in range(K)]
    want = [ttt_attention(q[k], keys[: k + 1], values[: k + 1]) for k in range(K)]
    cache = []
    for start in range(0, T, 4):
        span = slice(start, start + 4)
        attend = cached_attend(cache, start)
        for k in range(K):
            got = attend(q[k][:, span], keys[k][:, span], values[k][:, span])
            torch.testing.assert_close(got, want[k][:, span])


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_drafting_drafts_and_accepts_what_the_ttt_forward_does(data, chunk):
    """Every step's drafts at every anchor, and on text where every depth-0 draft is right (each
    next token is the drafter's own step-0 draft) the accepted lengths, equal the whole-sample TTT
    forward's; the aux states stay bf16."""
    _, drafter = head_and_drafter(data, torch.bfloat16)
    drafter.eval()
    T = 40
    aux = torch.randn(1, T, 3 * H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for t in range(T - 2):
            ids[0, t + 2] = drafter.draft_to_target(drafter(ids, aux.float(), 1)[0][0, t].argmax())
        logits = drafter(ids, aux.float(), K)
    for want, got in zip(logits, chain_drafts(drafter, ids, aux, K, chunk=chunk), strict=True):
        assert torch.equal(got, drafter.draft_to_target(want.argmax(-1)))
    batch = {"input_ids": ids, "loss_mask": torch.arange(T)[None] >= 2, "aux_hidden_states": aux}
    anchors, want = accepted_lengths(drafter, {**batch, "aux_hidden_states": aux.float()}, K, chunk=T)  # the whole sample
    got_anchors, got = accepted_lengths(drafter, batch, K, chunk=chunk)
    assert torch.equal(got_anchors, anchors) and torch.equal(got, want)
    assert (want[anchors] >= 1).all() and anchors.sum() == T - 3


def on_text(anchors):
    """Per anchor t: whether its deepest guess, x_{t+K+1}, falls on the served text (anchor t+K-1 is
    one): the drafts the agreement check counts (expected.sample_counts)."""
    return [t + K - 1 < len(anchors) and anchors[t + K - 1] for t in range(len(anchors))]


def test_the_agreement_checks_offline_side_runs_on_bf16_states(data, trained, tmp_path):
    """offline_estimates on bf16 agreement states of the bf16 target equals the whole-sample TTT
    forward's acceptance on the same states at temperature 0, and gives probabilities above it
    (the bf16 head). Every misread copy drafts too, sharing the embedding, its vocab maps its own."""
    root, target = data["root"], data["targets"][torch.bfloat16]
    rows = torch.randint(0, V, (3, 30), generator=torch.Generator().manual_seed(3)).tolist()
    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text("".join(json.dumps({"suite": "heldout", "temperature": t, "concurrency": 1, "id": f"o{i}",
                                           "prompt_token_ids": row[:6], "token_ids": row[6:], "finish_reason": "length"})
                               + "\n" for t in (0.0, 1.0) for i, row in enumerate(rows)))
    extract_agreement_states(outputs, root / "manifest.json", target, tmp_path / "states", backend="hf",
                             dtype="bfloat16", device="cpu", batch_tokens=4096, vllm=None, trust_remote_code=False)
    states = AgreementStates(tmp_path / "states")
    (_, _, greedy), (_, _, sampled) = states.texts()
    config = DrafterConfig(**json.loads((root / "drafter_config.json").read_text()))
    drafter = trained_drafter(trained, config, data["d2t"], data["t2d"], read_target_embedding(target))
    drafted = []
    for i in greedy:
        sample = states[i]
        assert sample["aux_hidden_states"].dtype == torch.bfloat16
        batch = {"input_ids": sample["input_ids"][None], "loss_mask": sample["loss_mask"][None],
                 "aux_hidden_states": sample["aux_hidden_states"][:, states.columns(AUX)][None].float()}
        anchors, lengths = accepted_lengths(drafter, batch, K)
        drafted += served_anchors(anchors[0].tolist(), lengths[0].tolist(), on_text(anchors[0].tolist()))
    reference = acceptance(drafted, K)
    (offline,) = offline_estimates(states, greedy, [(drafter, AUX)], [K], temperature=0.0, max_tokens=64, head=None,
                                   device="cpu")
    assert {key: offline[K][key] for key in reference} == reference
    head = TargetHead(target)
    (expected,) = offline_estimates(states, sampled, [(drafter, AUX)], [K], temperature=1.0, max_tokens=64,
                                    head=head, device="cpu")
    # the ceiling rides along in the same pass: the drafter's figures unchanged, the oracle's as alone
    with_ceiling, ceiling = offline_estimates(states, sampled, [(drafter, AUX)], [K], temperature=1.0, max_tokens=64,
                                              head=head, device="cpu", ceiling=True)
    assert with_ceiling == expected
    alone = [sample_counts(*ceiling_outcomes(states[i], min(int(states[i]["loss_mask"].sum()), 64), K, head=head,
                                             temperature=1.0, seed=sample_seed(states[i]["id"])), K) for i in sampled]
    assert ceiling[K] == estimate(alone, K)
    rates = expected[K]["acceptance_rate_per_position"]
    assert all(0 <= r <= 1 for r in rates) and rates == sorted(rates, reverse=True)
    assert all(0 <= se < float("inf") for se in expected[K]["standard_error_per_position"])  # 3 prompts: finite
    variants = misreadings(drafter, AUX, 4)
    assert {v.embed_tokens.weight.data_ptr() for _, v, _ in variants} == {drafter.embed_tokens.weight.data_ptr()}
    estimates = offline_estimates(states, greedy, [(variant, ids) for _, variant, ids in variants], [K],
                                  temperature=0.0, max_tokens=64, head=None, device="cpu")
    assert len(estimates) == len(variants) >= 3 and all(len(e[K]["acceptance_rate_per_position"]) == K for e in estimates)
    assert torch.equal(drafter.d2t, data["d2t"])
    # a bfloat16 engine: the replay computes the drafter as vLLM does, in the engine's dtype, and counts
    # the drafts whose outcome through depth k that rounding decides (the float32 replay's differs:
    # rounding_decided's counting is test_expected's)
    assert as_served(drafter, torch.float32) is drafter
    served = as_served(drafter, torch.bfloat16)
    assert served.fc.weight.dtype == torch.bfloat16 and torch.equal(served.d2t, drafter.d2t)
    (rounded,) = offline_estimates(states, greedy, [(served, AUX)], [K], temperature=0.0, max_tokens=64, head=None,
                                   device="cpu", exact=drafter)
    decided, drafts = [0] * K, 0
    for i in greedy:
        sample = states[i]
        batch = {"input_ids": sample["input_ids"][None], "loss_mask": sample["loss_mask"][None],
                 "aux_hidden_states": sample["aux_hidden_states"][:, states.columns(AUX)][None].float()}
        (anchors, lengths), (_, exact) = accepted_lengths(served, batch, K), accepted_lengths(drafter, batch, K)
        flags = anchors[0].tolist()
        walk = [t for t in served_positions(flags, lengths[0].tolist()) if on_text(flags)[t]]
        drafts += len(walk)
        for k in range(K):  # through depth k: the accepted lengths capped at k + 1 differ
            decided[k] += sum(min(int(lengths[0, t]), k + 1) != min(int(exact[0, t]), k + 1) for t in walk)
    assert rounded[K]["rounding_decided_per_position"] == [n / drafts for n in decided]
    assert tolerance(rounded[K], 0.0, None, agreement_tolerance=0.05, z=3) == [0.05 + n / drafts for n in decided]
    assert "rounding_decided_per_position" not in offline[K]  # a float32 engine: the replay is exact
