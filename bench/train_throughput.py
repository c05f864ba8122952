"""Benchmark: training tokens/s of the real loop against a bare forward+backward of the same
drafter on the same tokens (batches by token budget).

One run, CPU, one torch thread, float32 compute, a small width with Kimi-K2.5's proportions
(target hidden 256 and vocab 4,096: 16x wider than deep as Kimi's 7168/163,840 is 23x; drafter
4 heads and 2 KV heads of 64, intermediate 688, draft vocab 1,024, K=3). 64 samples of 32 to
1,024 random tokens (the first tenth a prompt), their states random bf16 in 2 shards written to
a temp dir, as extraction stores them at scale. Budgets: micro-batches of 2,048 padded tokens,
steps of 4,096 supervised tokens; one epoch, its steps as the loop plans them.
  loop   `train_steps` of eaglenest.train.loop (DataLoader with num_workers 0 or 1, collate of
         the shards' bf16 states, the cast on the device, the target head, the loss, backward,
         clipping, AdamW, logging)
  bare   the same micro-batches already collated in memory as float32, the target's
         distribution precomputed (untimed): Drafter.forward + the same loss (soft_ce_loss) +
         backward + AdamW step; no loader, no target head, no clipping
Columns alternate, ROUNDS times each. Seconds and tokens/s are each column's median; the ratio
is the median over rounds of bare/loop within the round (the machine is shared: a ratio of
neighbouring passes cancels slow drifts of its load). Two more rows time the loop's own parts
alone (reading + collate + cast; the target head) to say where time goes.

`--recipes a,b`: instead, the loop (num_workers 0) of each training recipe of
bench/recipe_ablation.py's VARIANTS on the same data, alternating, ROUNDS times: seconds per
optimizer step (median) and its ratio to the first recipe's in the same round (median). With
`--demo`, on an earlier `make demo`'s shards, vocabulary, target and geometry (results/), the
first DEMO_STEPS optimizer steps, on 2 threads: the step as the demo trains it.

    .venv/bin/python bench/train_throughput.py    # prints a Markdown table (~7 min on 2 cores)
    .venv/bin/python bench/train_throughput.py --recipes ours,muon [--demo]
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NUM_SAMPLES = 64
TARGET = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
DRAFT_VOCAB = 1024
BUDGETS = dict(max_tokens_per_batch=2048, tokens_per_step=4096)
K = 3
ROUNDS = 5
DEMO_STEPS = 150  # --demo: optimizer steps a pass
RECIPE_KEYS = ("lr", "warmup", "schedule", "optimizer", "weight_decay", "muon_lr", "muon_weight_decay", "train_lm_head")
RECIPE = yaml.safe_load((REPO / "config.yaml").read_text())["train"]  # the demo's recipe


def write_data(root):
    """The target (random), 2 shards of random bf16 states, the manifest and vocab maps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglenest.data.vocab import count_tokens, draft_maps, select_draft_vocab
    from eaglenest.states.manifest import write_manifest
    from eaglenest.states.shards import write_shard
    from eaglenest.workflow.atomic import save_torch

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TARGET)).save_pretrained(root / "target")
    H, V = TARGET["hidden_size"], TARGET["vocab_size"]
    lengths = torch.randint(32, 1025, (NUM_SAMPLES,)).tolist()
    samples = [{
        "id": f"t{i}", "input_ids": torch.randint(0, V, (n,)),
        "loss_mask": torch.arange(n) >= n // 10,
        "aux_hidden_states": torch.randn(n, 3 * H).bfloat16(),
        "final_hidden_states": (2 * torch.randn(n, H)).bfloat16(),
    } for i, n in enumerate(lengths)]
    shards = [root / "shard_0.safetensors", root / "shard_1.safetensors"]
    for shard, part in zip(shards, (samples[::2], samples[1::2])):
        write_shard(shard, part, hidden_size=H, dtype=torch.bfloat16)
    write_manifest(shards, root / "target", root / "manifest.json", aux_layer_ids=None, dtype="bfloat16")
    counts = count_tokens([{"input_ids": s["input_ids"].tolist(), "loss_mask": s["loss_mask"].tolist()}
                           for s in samples], V)
    for name, tensor in zip(("d2t.pt", "t2d.pt"), draft_maps(select_draft_vocab(counts, DRAFT_VOCAB), V)):
        save_torch(root / name, tensor)
    return shards


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def loop_pass(run, num_workers, recipe=None):
    """One epoch of the real loop from step 0 (`recipe`: the train settings it reads, by default
    config.yaml's)."""
    from eaglenest.train.loop import Progress, train_steps

    recipe = recipe or RECIPE
    train_steps(run, Progress(), None, ttt_steps=K, step_weight_decay=recipe["step_weight_decay"],
                max_grad_norm=recipe["max_grad_norm"], log_every=10**9,
                # the fitted temperature costs the same at any value: the default 1.0
                loss_settings=dict(supervise=recipe["supervise"], tv_weight=recipe["tv_weight"]),
                num_workers=num_workers, pin_memory=False, bf16=False, resume_dir=None, checkpoint_every=10**9)


def new_run(shards, root, recipe, geometry=None):
    """start_run on the written data with a recipe's train settings."""
    from eaglenest.states.manifest import read_manifest
    from eaglenest.train.loop import start_run

    settings = {key: recipe[key] for key in RECIPE_KEYS}
    return start_run(shards, read_manifest(root / "manifest.json"), root / "d2t.pt", root / "t2d.pt", root / "target",
                     False, seed=0, ttt_steps=K, epochs=1, max_steps=None, heldout_fraction=0.0, init_from=None,
                     drafter_geometry=geometry, device="cpu", **BUDGETS, **settings)


def demo_run(recipe, geometry):
    """start_run on `make demo`'s results/ with a recipe's settings and the demo's budgets, DEMO_STEPS steps."""
    from eaglenest.states.manifest import read_manifest
    from eaglenest.train.loop import start_run

    results = REPO / "results"
    keys = (*RECIPE_KEYS, "max_tokens_per_batch", "tokens_per_step", "heldout_fraction", "epochs")
    return start_run(sorted((results / "hidden_states").glob("shard_*.safetensors")),
                     read_manifest(results / "hidden_states/manifest.json"), results / "vocab/d2t.pt",
                     results / "vocab/t2d.pt", results / "target", False, seed=0, ttt_steps=K, max_steps=DEMO_STEPS,
                     init_from=None, drafter_geometry=geometry, device="cpu", **{key: recipe[key] for key in keys})


def recipes_side_by_side(names, demo):
    """Seconds per optimizer step of the loop under each recipe (recipe_ablation.VARIANTS),
    alternating: on the synthetic data, or (`demo`) on make demo's."""
    from recipe_ablation import demo_config, settings

    config = demo_config()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = None if demo else write_data(root)
        runs = {}
        for name in names:
            train, drafter = settings(name, config)
            runs[name] = (demo_run(train, drafter) if demo else new_run(shards, root, train, drafter), train)
            loop_pass(runs[name][0], 0, train)  # warm-up
        steps = DEMO_STEPS if demo else len(runs[names[0]][0].plan(0))
        seconds = {name: [] for name in names}
        for _ in range(ROUNDS):
            for name, (run, train) in runs.items():
                seconds[name].append(timed(lambda: loop_pass(run, 0, train)) / steps)
    print(f"{steps} optimizer steps a pass ({'the demo' if demo else 'synthetic data'}); CPU, "
          f"{torch.get_num_threads()} threads; medians of {ROUNDS} rounds\n")
    print("| recipe | seconds per step | ratio to " + names[0] + " |")
    print("|---|---|---|")
    for name in names:
        ratio = statistics.median(t / b for t, b in zip(seconds[name], seconds[names[0]]))
        print(f"| {name} | {statistics.median(seconds[name]):.3f} | **{ratio:.2f}** |")


def bare_inputs(run, steps):
    """Per step: its normalisers and its micro-batches as float32 tensors with the target's
    distribution, computed here (untimed)."""
    from eaglenest.states.shards import collate
    from eaglenest.train.batches import step_normalisers

    inputs = []
    for step in steps:
        batches = []
        for indices in step:
            batch = collate([run.samples[i] for i in indices])
            batch = {k: t.float() if t.is_floating_point() else t for k, t in batch.items()}
            probs, in_vocab = run.head.distribution(batch["final_hidden_states"], run.drafter.t2d)
            batches.append((batch["input_ids"], batch["aux_hidden_states"], batch["loss_mask"], probs, in_vocab))
        inputs.append((step_normalisers(step, run.counts), batches))
    return inputs


def bare_pass(run, inputs):
    """Forward + loss + backward per micro-batch, an AdamW step per optimizer step."""
    from eaglenest.train.loss import soft_ce_loss

    for normalisers, batches in inputs:
        run.optimizer.zero_grad()
        for ids, aux, mask, probs, in_vocab in batches:
            loss, _ = soft_ce_loss(run.drafter(ids, aux, K), probs, in_vocab, mask, normalisers,
                                   RECIPE["step_weight_decay"])
            loss.backward()
        run.optimizer.step()


def parts_alone(run, steps):
    """Seconds of the loop's loader (read, collate, cast) and of its target head alone."""
    from eaglenest.train.loop import epoch_loader

    batches = []
    loading = timed(lambda: batches.extend(
        {k: t.float() if t.is_floating_point() else t for k, t in batch.items()}
        for _, batch in epoch_loader(run, steps, 0, False)))
    head = timed(lambda: [run.head.distribution(b["final_hidden_states"], run.drafter.t2d) for b in batches])
    return loading, head


def main():
    demo = "--demo" in sys.argv
    torch.set_num_threads(2 if demo else 1)
    if sys.argv[1:2] == ["--recipes"]:
        return recipes_side_by_side(sys.argv[2].split(","), demo)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = write_data(root)
        run = new_run(shards, root, RECIPE | {"lr": 1e-4, "warmup": 0})
        steps = run.plan(0)
        micro = [b for step in steps for b in step]
        lengths = [end - start for _, start, end, _ in run.samples.index]
        tokens = sum(lengths)
        padded = sum(len(b) * max(lengths[i] for i in b) for b in micro)
        inputs = bare_inputs(run, steps)
        bare_pass(run, inputs[:1])  # warm-up
        seconds = {"loop, num_workers 0": [], "loop, num_workers 1": [], "bare": []}
        for _ in range(ROUNDS):
            seconds["bare"].append(timed(lambda: bare_pass(run, inputs)))
            for workers in (0, 1):
                seconds[f"loop, num_workers {workers}"].append(timed(lambda: loop_pass(run, workers)))
        loading, head = parts_alone(run, steps)
    bare = statistics.median(seconds["bare"])
    print(f"seconds per round: {seconds}\n")
    print(f"{NUM_SAMPLES} samples, {tokens:,} tokens ({padded / tokens - 1:.1%} padding), {len(micro)} micro-batches "
          f"in {len(steps)} steps; CPU, 1 thread; medians of {ROUNDS}\n")
    print("| | seconds | tokens/s | ratio to bare |")
    print("|---|---|---|---|")
    for name in ("bare", "loop, num_workers 0", "loop, num_workers 1"):
        s = statistics.median(seconds[name])
        ratio = statistics.median(b / t for b, t in zip(seconds["bare"], seconds[name]))
        print(f"| {name} | {s:.2f} | {tokens / s:,.0f} | **{ratio:.2f}** |")
    for name, s in (("loop's loader alone (read, collate, cast)", loading), ("loop's target head alone", head)):
        print(f"| {name} | {s:.2f} | | {s / bare:.1%} of bare |")


if __name__ == "__main__":
    main()
