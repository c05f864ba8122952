"""Batches by token budget: the pure batching functions, and real training on shards of samples of
many lengths (one process against two DDP processes, accumulating several micro-batches a step),
the speed-only options, and the offline evaluation at two budgets."""

import csv
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import write_training_data
from eaglenest.data.samples import is_heldout
from eaglenest.drafter.load import read_checkpoint
from eaglenest.evaluate.offline import evaluate_offline
from eaglenest.states.shards import ShardSamples, budget_batches, collate, length_batches
from eaglenest.train.batches import epoch_micro_batches, epoch_steps, optimizer_steps, rank_rounds, step_normalisers
from eaglenest.train.loop import supervision, train_drafter
from eaglenest.train.loss import MASK_OFFSET

BUDGET = 4096
RNG = random.Random(0)
LENGTHS = [RNG.randint(16, 1000) for _ in range(3000)] + [5000, 9000]  # two past the budget


def padding(batches, lengths):
    """Padded tokens: count × longest less the samples' own tokens, over all batches."""
    return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in batches)


@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_micro_batches_keep_the_budget_and_hold_every_sample_once(epoch):
    batches = epoch_micro_batches(LENGTHS, BUDGET, seed=3, epoch=epoch)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    for batch in batches:
        assert len(batch) * max(LENGTHS[i] for i in batch) <= BUDGET or len(batch) == 1
    for long in (len(LENGTHS) - 2, len(LENGTHS) - 1):
        assert [long] in batches  # longer than the budget: a batch of its own


def test_micro_batches_are_a_pure_function_of_seed_and_epoch():
    first = epoch_micro_batches(LENGTHS, BUDGET, seed=3, epoch=1)
    assert epoch_micro_batches(list(LENGTHS), BUDGET, seed=3, epoch=1) == first
    assert epoch_micro_batches(LENGTHS, BUDGET, seed=3, epoch=2) != first
    assert epoch_micro_batches(LENGTHS, BUDGET, seed=4, epoch=1) != first


def test_bucketing_pads_far_less_than_batching_in_shuffled_order():
    order = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(0)).tolist()
    unbucketed = padding(budget_batches(order, LENGTHS, BUDGET), LENGTHS)
    bucketed = padding(epoch_micro_batches(LENGTHS, BUDGET, seed=0, epoch=0), LENGTHS)
    assert bucketed < unbucketed / 10
    assert bucketed < 0.05 * sum(LENGTHS)


def test_unsorted_micro_batches_keep_the_shuffled_order_and_mix_lengths():
    """train.length_sorted false: the epoch's shuffled order cut by the budget as it comes (the
    same permutation as the sorted batches start from), every sample once, deterministic."""
    batches = epoch_micro_batches(LENGTHS, BUDGET, seed=3, epoch=1, length_sorted=False)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    assert epoch_micro_batches(LENGTHS, BUDGET, seed=3, epoch=1, length_sorted=False) == batches
    order = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(3 + 1_000_003)).tolist()
    assert sorted(batches) == sorted(budget_batches(order, LENGTHS, BUDGET))
    sorted_batches = epoch_micro_batches(LENGTHS, BUDGET, seed=3, epoch=1)
    assert padding(batches, LENGTHS) > 10 * padding(sorted_batches, LENGTHS)


def test_length_batches_unshuffled_sort_all_samples():
    batches = length_batches(range(len(LENGTHS)), LENGTHS, BUDGET)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(LENGTHS)))
    assert [LENGTHS[i] for i in flat] == sorted(LENGTHS)
    assert length_batches(range(0), [], BUDGET) == []


def test_optimizer_steps_take_consecutive_micro_batches_up_to_the_token_budget():
    supervised = [n // 2 for n in LENGTHS]
    batches = epoch_micro_batches(LENGTHS, BUDGET, seed=0, epoch=0)
    steps = optimizer_steps(batches, supervised, 20_000)
    assert [b for step in steps for b in step] == batches
    held = [[sum(supervised[i] for i in b) for b in step] for step in steps]
    for step in held[:-1]:
        assert sum(step) >= 20_000 > sum(step[:-1])  # the fewest micro-batches that reach the budget
    assert 0 < sum(held[-1]) and sum(held[-1][:-1]) < 20_000
    assert epoch_steps(LENGTHS, supervised, BUDGET, 20_000, 0, 0) == steps


def test_packed_steps_are_consecutive_runs_of_the_shuffled_order_within_the_token_budget():
    """train.packed_steps: each step is the longest run of the epoch's shuffled order whose
    tokens, prompts included, fit tokens_per_step (a longer sample alone), as speculators packs
    a batch; its micro-batches keep max_tokens_per_batch."""
    budget = 8000
    steps = epoch_steps(LENGTHS, None, BUDGET, budget, seed=3, epoch=1, packed=True)
    order = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(3 + 1_000_003)).tolist()
    assert [i for step in steps for batch in step for i in batch] == order
    runs = [[i for batch in step for i in batch] for step in steps]
    for run, after in zip(runs, runs[1:] + [None]):
        held = sum(LENGTHS[i] for i in run)
        assert held <= budget or len(run) == 1
        if after:
            assert held + LENGTHS[after[0]] > budget  # the next sample would not have fit
    assert [len(LENGTHS) - 1] in runs  # 9,000 tokens: a step of its own
    for batch in (batch for step in steps for batch in step):
        assert len(batch) * max(LENGTHS[i] for i in batch) <= BUDGET or len(batch) == 1
    assert epoch_steps(LENGTHS, None, BUDGET, budget, seed=3, epoch=1, packed=True, length_sorted=False) == steps


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_take_turns_of_a_steps_micro_batches(world_size):
    step = [[0, 1], [2], [3, 4, 5], [6], [7]]
    rounds = [rank_rounds(step, rank, world_size) for rank in range(world_size)]
    assert len({len(r) for r in rounds}) == 1  # as many rounds each: they meet at every all-reduce
    real = [batch for turn in zip(*rounds) for is_real, batch in turn if is_real]
    assert real == step
    dummies = [batch for r in rounds for is_real, batch in r if not is_real]
    assert all(batch == [7] for batch in dummies) and len(dummies) == -len(step) % world_size


def test_step_normalisers_count_the_whole_step():
    counts = [[5, 4, 3], [2, 1, 0], [7, 7, 6]]
    assert step_normalisers([[0, 1], [2]], counts) == [14, 12, 9]
    assert step_normalisers([[1]], [[0, 0, 0], [0, 0, 0]]) == [1, 1, 1]


V, N, HELDOUT = 128, 48, 0.25


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A random tiny 8-layer Llama; 40 samples of 12 to 90 random tokens, supervised after a
    prompt of 3 to 10; their states in 2 bfloat16 shards; a 48-token draft vocab."""
    root = tmp_path_factory.mktemp("batches")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(root / "target")
    rng = random.Random(0)
    samples = []
    for i in range(40):
        n, prompt = rng.randint(12, 90), rng.randint(3, 10)
        samples.append({"id": f"b{i}", "input_ids": [rng.randrange(V) for _ in range(n)],
                        "loss_mask": [0] * prompt + [1] * (n - prompt)})
    return root, write_training_data(root, samples, 20, dtype="bfloat16", vocab_size=V, draft_vocab_size=N)


# micro-batches of at most 160 padded tokens (1 to 13 samples), steps of at least 240 supervised
BUDGETS = dict(max_tokens_per_batch=160, tokens_per_step=240)
STEPS = 12


def train(data, name, **kwargs):
    """train_drafter on `data` into root/name (log root/name.tsv), kwargs over these settings."""
    root, shards = data
    settings = dict(seed=0, ttt_steps=3, max_steps=STEPS, lr=3e-3, warmup=2, heldout_fraction=HELDOUT, log_every=4,
                    device="cpu", **BUDGETS)
    train_drafter(shards, root / "manifest.json", root / "d2t.pt", root / "t2d.pt", root / "target", root / name,
                  root / f"{name}.tsv", **settings | kwargs)
    return root / name


@pytest.fixture(scope="module")
def one_process(data):
    return train(data, "one")


def assert_same_training(out, reference, atol):
    _, weights = read_checkpoint(out)
    _, expected = read_checkpoint(reference)
    for name, tensor in expected.items():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=atol), name
    with open(f"{out}.tsv") as f, open(f"{reference}.tsv") as g:
        rows, expected_rows = list(csv.DictReader(f, delimiter="\t")), list(csv.DictReader(g, delimiter="\t"))
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in expected_rows]
    for row, expected_row in zip(rows, expected_rows):
        assert float(row["loss"]) == pytest.approx(float(expected_row["loss"]), abs=1e-3)


@pytest.mark.parametrize("alignment", ["predicted", "input"])
def test_supervision_counts_the_positions_the_loss_supervises(data, alignment):
    """Per sample and TTT step k, supervision()'s count is the loss_mask positions from
    k + 1 + offset on (the loss's mask at that alignment), before any batch is loaded."""
    _, shards = data
    samples = ShardSamples(shards)
    supervised, counts = supervision(samples, 3, alignment)
    offset = MASK_OFFSET[alignment]
    for i in range(0, len(samples), 7):
        mask = samples[i]["loss_mask"]
        assert supervised[i] == int(mask.sum())
        assert counts[i] == [int(mask[k + 1 + offset :].sum()) for k in range(3)]


def test_collate_keeps_the_stored_dtype(data):
    _, shards = data
    samples = ShardSamples(shards)
    batch = collate([samples[0], samples[1]])
    assert batch["aux_hidden_states"].dtype == batch["final_hidden_states"].dtype == torch.bfloat16
    assert batch["input_ids"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.bool


def test_two_ddp_processes_accumulating_micro_batches_train_as_one(data, one_process):
    """The steps hold several micro-batches (some an odd number: a rank takes a dummy); two DDP
    processes taking turns of them end with one process's weights to float rounding."""
    root, shards = data
    samples = ShardSamples(shards, keep=lambda i: not is_heldout(i, HELDOUT))
    supervised, _ = supervision(samples, 3)
    lengths = [end - start for _, start, end, _ in samples.index]
    steps = epoch_steps(lengths, supervised, BUDGETS["max_tokens_per_batch"], BUDGETS["tokens_per_step"], 0, 0)
    assert max(len(step) for step in steps) >= 3 and any(len(step) % 2 for step in steps)
    assert len({len(b) for step in steps for b in step}) > 2  # micro-batches of many sizes
    assert_same_training(train(data, "ddp", num_processes=2), one_process, atol=5e-5)


def test_a_packed_step_trains_alike_in_one_micro_batch_or_padded_in_several(data):
    """Padding where speculators packs changes no gradient: packed steps of 300 tokens trained
    as one micro-batch each, and cut into micro-batches of 60 padded tokens, end alike to float
    rounding (measured: the largest weight difference 8.1e-7; the bound 1e-5)."""
    packed = dict(packed_steps=True, tokens_per_step=300)
    whole = train(data, "packed_whole", max_tokens_per_batch=100_000, **packed)
    assert_same_training(train(data, "packed_padded", max_tokens_per_batch=60, **packed), whole, atol=1e-5)


def test_loader_workers_and_activation_checkpointing_change_nothing(data, one_process):
    out = train(data, "options", num_workers=2, pin_memory=True, activation_checkpointing=True, bf16=False)
    assert_same_training(out, one_process, atol=1e-6)


def distance(out, reference):
    """The L2 norm of the difference of two checkpoints' weights, all tensors as one vector."""
    _, weights = read_checkpoint(out)
    _, expected = read_checkpoint(reference)
    return torch.cat([(weights[name].double() - tensor.double()).flatten() for name, tensor in expected.items()]).norm()


def losses(out):
    with open(f"{out}.tsv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f, delimiter="\t")]


def test_bf16_autocast_runs_on_cpu_and_trains_as_float32_does(data, one_process):
    """bf16 autocast trains: its weights end near float32's compared with how far float32's
    moved from the initial ones, and its loss falls as float32's does. Measured (12 steps): float32
    moved 2.121 from the initial weights, bf16 2.121, and bf16 ended 0.076 from float32 (0.036 of
    float32's move; largest weight difference 0.0095, float32's largest move 0.020); the logged loss
    fell 0.0356 in float32 and 0.0357 in bf16. A bf16 run that does not train (lr 1e-9) ends 2.121
    (1.0 of the move) from float32 and its loss does not fall. Bounds: 0.25 of the move (7x the
    measured 0.036; it also means bf16 moved at least 0.75 of float32's way) and half the fall."""
    initial = train(data, "initial", max_steps=0)
    bf16 = train(data, "bf16", bf16=True)
    assert distance(bf16, one_process) < 0.25 * distance(one_process, initial)
    fell, fell_in_float32 = losses(bf16)[0] - losses(bf16)[-1], losses(one_process)[0] - losses(one_process)[-1]
    assert fell > 0.5 * fell_in_float32 > 0, (losses(bf16), losses(one_process))


def test_offline_figures_do_not_depend_on_the_token_budget(data, one_process):
    root, shards = data
    figures = [
        evaluate_offline(shards, root / "manifest.json", one_process, root / "target", root / f"eval_{budget}.json",
                         heldout_fraction=HELDOUT, num_speculative_tokens=3, max_tokens_per_batch=budget)
        for budget in (1, 90, 100_000)  # one sample per batch, a few, all at once
    ]
    assert figures[0]["heldout_samples"] > 5
    assert figures[0] == figures[1] == figures[2]
