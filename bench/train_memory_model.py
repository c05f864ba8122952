"""Benchmark: the training memory model (eaglenest.train.memory) against measured peaks, and what it
says for Kimi-K2.5 on one 96 GB GPU.

Measured: one training micro-step on CPU, in a fresh process per size, of real pieces with small
random weights: a target written to a temp dir (config.json and model.safetensors: embed_tokens,
norm, an untied lm_head, bf16), its TargetHead, the drafter new_drafter makes for it (geometry from
make_drafter_config: the target's own attention and MLP; the norm flags a size asks for), its
optimizers as start_run builds them (AdamW, or Muon and AdamW; lm_head frozen where a size says
so), and a micro-batch as collate gives it (random states, stored bf16). The step
is the loop's (eaglenest.train.loop.optimizer_step): the cast of the states to float32,
ttt_loss (TargetHead.distribution, Drafter.forward with K = 3, the soft CE, plus the total
variation term where a size gives tv_weight), backward, gradient clipping, AdamW's step. One such
step runs first (it makes AdamW's moments and warms the kernels up), then the gradients are
dropped as the loop's zero_grad(set_to_none) does, or kept to stand for the earlier micro-batches
of an accumulating step. Then the RSS high-water mark is reset
(/proc/self/clear_refs) and the measured step runs: the figure is VmHWM after it minus VmRSS at
the reset. glibc's mmap threshold is fixed at 64 kB (MALLOC_MMAP_THRESHOLD_), so each tensor is
its own mapping, returned when freed, and RSS follows the live tensors. One torch thread.

On CPU there is no separate device memory, so what the process held at the reset is left out on
both sides: the measurement starts there, and the model's figure is its peak (device="cpu") minus
the terms held then: memory.BETWEEN_STEPS (weights, AdamW's moments, the target's tensors, the
vocab maps), the collated batch and, when accumulating, the gradients. What remains is everything
the step allocates: the float32 casts of the batch, the target's distribution and its chunk
logits, the activations, logits and attention scores, the gradients, AdamW's transient. MB here
is 2^20 bytes.

Kimi-K2.5: the model's figures only (no GPU measured them) for the drafter make_drafter_config
gives Kimi's config.json (tests/kimi_k25_config.json), draft vocab 32,000, K = 3, a bf16 target
and shards, bf16 autocast, one sample as long as the micro-batch budget, gradients accumulating;
GB is 10^9 bytes, the GPU's 96 GB taken as 96 × 10^9 (the smaller reading), 10% kept free.

The sizes are of the gqa layer, then of the mla layer (MLA_LAYER's fields). `--kimi-layers`: the
README's Kimi-K2.5 run (16,384 tokens, checkpointing, 8 DDP processes) per drafter layer.

    .venv/bin/python bench/train_memory_model.py                 # prints Markdown tables (~6 min on 2 cores)
    .venv/bin/python bench/train_memory_model.py --layer mla     # the mla sizes only (~3 min)
    .venv/bin/python bench/train_memory_model.py --kimi-layers   # Kimi-K2.5's peak per GPU, each layer
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglenest.train.memory import BETWEEN_STEPS, parameter_counts, training_memory  # noqa: E402

MB, GB = 2**20, 10**9
K = 3
# An mla layer's own fields (MLAttention), in Kimi-K2.5's proportions: q_lora_rank, kv_lora_rank,
# qk_nope_head_dim, qk_rope_head_dim, v_head_dim.
MLA_LAYER = dict(layer="mla", q_lora=192, kv_lora=64, nope=32, rope=16, v=32)
# The sizes the test checks (tests/test_memory_model.py), then a few more for the bench.
TEST_SIZES = [
    dict(hidden=256, heads=4, intermediate=688, target_vocab=8000, draft_vocab=2000, samples=2, longest=1024),
    dict(hidden=512, heads=8, intermediate=1376, target_vocab=16000, draft_vocab=4000, samples=1, longest=1024,
         checkpointing=True, accumulate=True),
    dict(hidden=384, heads=6, intermediate=1024, target_vocab=32000, draft_vocab=8000, samples=3, longest=512,
         autocast=True),
    dict(hidden=256, heads=16, intermediate=688, target_vocab=8000, draft_vocab=500, samples=1, longest=1024,
         checkpointing=True),
    dict(hidden=256, heads=4, intermediate=688, target_vocab=8000, draft_vocab=2000, samples=2, longest=1024,
         norms=True, optimizer="muon", train_lm_head=False, tv_weight=1.0),
    dict(hidden=384, heads=6, intermediate=1024, target_vocab=32000, draft_vocab=8000, samples=3, longest=512,
         autocast=True, norms=True, optimizer="muon", tv_weight=1.0),
    dict(MLA_LAYER, hidden=256, heads=4, intermediate=688, target_vocab=8000, draft_vocab=500, samples=1,
         longest=2048),
    dict(MLA_LAYER, hidden=384, heads=6, intermediate=1024, target_vocab=32000, draft_vocab=8000, samples=3,
         longest=512, autocast=True, checkpointing=True, accumulate=True, optimizer="muon"),
]
MORE_SIZES = [
    dict(hidden=256, heads=4, intermediate=688, target_vocab=8000, draft_vocab=2000, samples=1, longest=4096),
    dict(hidden=256, heads=4, intermediate=688, target_vocab=8000, draft_vocab=2000, samples=1, longest=4096,
         checkpointing=True),
    dict(hidden=512, heads=8, intermediate=1376, target_vocab=32000, draft_vocab=16000, samples=4, longest=256,
         accumulate=True, autocast=True, checkpointing=True),
    dict(hidden=256, heads=4, intermediate=688, target_vocab=64000, draft_vocab=1000, samples=2, longest=1024),
    dict(hidden=256, heads=4, intermediate=688, target_vocab=64000, draft_vocab=1000, samples=3, longest=2048),
    dict(hidden=256, heads=16, intermediate=688, target_vocab=8000, draft_vocab=500, samples=1, longest=2048),
    dict(hidden=256, heads=16, intermediate=688, target_vocab=8000, draft_vocab=500, samples=1, longest=2048,
         autocast=True, checkpointing=True),
    dict(MLA_LAYER, hidden=256, heads=4, intermediate=688, target_vocab=8000, draft_vocab=2000, samples=2,
         longest=1024),
    dict(MLA_LAYER, hidden=256, heads=4, intermediate=688, target_vocab=8000, draft_vocab=2000, samples=1,
         longest=4096, checkpointing=True),
    dict(MLA_LAYER, hidden=256, heads=16, intermediate=688, target_vocab=8000, draft_vocab=500, samples=1,
         longest=2048, autocast=True),
    dict(MLA_LAYER, hidden=256, heads=16, intermediate=688, target_vocab=8000, draft_vocab=500, samples=1,
         longest=2048, autocast=True, checkpointing=True),
]
KIMI_BUDGETS = [8192, 16384, 32768]
KIMI_DRAFT_VOCAB = 32000
GPU_BYTES, MARGIN = 96 * GB, 0.10


def size_defaults(size):
    """A size with every field: the gqa layer of 64-dim heads, 2 KV heads (mla: MLA_LAYER's fields
    given, the KV heads the heads, head_dim the rope part), float32 compute, fresh gradients, the
    norm flags off (norms: norm_before_fc and norm_output on), AdamW, lm_head trained, the soft CE
    alone (tv_weight 0)."""
    size = dict(layer="gqa", head_dim=64, kv_heads=2, checkpointing=False, autocast=False, accumulate=False,
                norms=False, optimizer="adamw", train_lm_head=True, tv_weight=0.0) | size
    return size | (dict(head_dim=size["rope"], kv_heads=size["heads"]) if size["layer"] == "mla" else {})


def geometry(size):
    """The DrafterConfig fields a size sets over the target's geometry: the norm flags, and an mla
    layer's own."""
    flags = {"norm_before_residual": False, "norm_before_fc": size["norms"], "norm_output": size["norms"]}
    if size["layer"] == "gqa":
        return flags
    return flags | {"layer": "mla", "q_lora_rank": size["q_lora"], "kv_lora_rank": size["kv_lora"],
                    "qk_nope_head_dim": size["nope"], "qk_rope_head_dim": size["rope"], "v_head_dim": size["v"]}


def write_target(root, size):
    """A Llama-style target of `size` in `root`: config.json and model.safetensors (bf16)."""
    import torch
    from safetensors.torch import save_file

    H, V = size["hidden"], size["target_vocab"]
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, vocab_size=V,
                  num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"],
                  intermediate_size=size["intermediate"], num_hidden_layers=8, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, max_position_embeddings=8192, dtype="bfloat16")
    (root / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
               "lm_head.weight": torch.randn(V, H, generator=g, dtype=torch.bfloat16) / H**0.5},
              str(root / "model.safetensors"))
    return config


def build(root, size):
    """(drafter, target head, optimizer, collated batch) for `size`, as start_run and collate make them."""
    import torch

    from eaglenest.states.convention import FINAL_STATE_CONVENTION
    from eaglenest.train.init_drafter import new_drafter
    from eaglenest.train.optim import build_optimizers
    from eaglenest.drafter.target_head import TargetHead

    config = write_target(root, size)
    head = TargetHead(root)
    N, V, H = size["draft_vocab"], size["target_vocab"], size["hidden"]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(1))[:N]] = True
    d2t = t2d.nonzero().squeeze(1) - torch.arange(N)
    manifest = {"hidden_size": H, "aux_layer_ids": [1, 4, 6], "final_state": FINAL_STATE_CONVENTION}
    drafter = new_drafter(root, manifest, d2t, t2d, head, seed=0, geometry=geometry(size))
    assert drafter.config == drafter_config(size, config["max_position_embeddings"])  # what the model is given
    drafter.activation_checkpointing = size["checkpointing"]
    drafter.train()
    drafter.lm_head.weight.requires_grad_(size["train_lm_head"])
    optimizer = build_optimizers(drafter, optimizer=size["optimizer"], lr=1e-4, weight_decay=0.0, muon_lr=None,
                                 muon_weight_decay=0.1, warmup=0, total_steps=10, schedule="cosine")
    B, T = size["samples"], size["longest"]
    g = torch.Generator().manual_seed(2)
    batch = {"input_ids": torch.randint(0, V, (B, T), generator=g), "loss_mask": torch.ones(B, T, dtype=torch.bool),
             "aux_hidden_states": torch.randn(B, T, 3 * H, generator=g, dtype=torch.bfloat16),
             "final_hidden_states": torch.randn(B, T, H, generator=g, dtype=torch.bfloat16)}
    return drafter, head, optimizer, batch


def training_step(drafter, head, optimizer, stored, size):
    """One micro-batch and the optimizer step, as eaglenest.train.loop.optimizer_step runs them."""
    import torch

    from eaglenest.train.loss import ttt_loss

    batch = {key: t.to("cpu") for key, t in stored.items()}
    batch.update({key: t.float() for key, t in batch.items() if t.is_floating_point()})
    normalisers = [max(batch["loss_mask"][:, k + 2:].sum().item(), 1) for k in range(K)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=size["autocast"]):
        loss, _ = ttt_loss(drafter, batch, head, drafter.t2d, K, 0.8, normalisers, tv_weight=size["tv_weight"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in drafter.parameters() if p.requires_grad], 0.5)
    optimizer.step()


def kb(field):
    """VmRSS or VmHWM of this process, in kB."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def measure(size):
    """In this process: the measured step's peak bytes above the RSS at the reset, and its seconds."""
    import gc

    import torch

    torch.set_num_threads(1)
    size = size_defaults(size)
    with tempfile.TemporaryDirectory() as tmp:
        drafter, head, optimizer, batch = build(Path(tmp), size)
    training_step(drafter, head, optimizer, batch, size)  # AdamW's moments, the kernels warmed up
    if not size["accumulate"]:
        optimizer.zero_grad()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base, start = kb("VmRSS"), time.perf_counter()
    training_step(drafter, head, optimizer, batch, size)
    return {"bytes": (kb("VmHWM") - base) * 1024, "seconds": time.perf_counter() - start}


def measure_loss_backward(positions=2048, draft_vocab=8000):
    """In this process: the peaks of one TTT step's loss backward, soft_ce_loss with tv_weight 0 and
    1 over float32 logits [1, positions, N] from a Linear (a GPU's autocast leaves log_softmax
    float32), above the RSS when it starts, in float32 [positions - 2, N] (log_softmax's size).
    The model counts two at either: at_backward_start the soft CE's gradient and log_softmax's of
    its input; at_backward_tv TotalVariation.backward's q and q - p, made before the soft CE's
    gradient (autograd runs the branch made later first), which autograd then adds in place into
    the gradient the TV's backward returned. Were the order the other way, the TV's would be three."""
    import torch

    from eaglenest.train.loss import soft_ce_loss

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(1, positions, 64, generator=g), torch.randn(draft_vocab, 64, generator=g)
    weight.requires_grad_()
    probs = torch.randn(1, positions, draft_vocab, generator=g).softmax(-1)
    mask = torch.ones(1, positions, dtype=torch.bool)
    peaks = []
    for tv_weight in (0.0, 1.0):
        loss, _ = soft_ce_loss([hidden @ weight.T], probs, mask, mask, [1], 0.8, tv_weight=tv_weight)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = kb("VmRSS")
        loss.backward()
        peaks.append((kb("VmHWM") - base) * 1024 / (4 * (positions - 2) * draft_vocab))
        weight.grad = None
    return peaks


def in_fresh_process(*args):
    """This file run with `args` in a fresh interpreter, with glibc's mmap threshold fixed: its last line, parsed."""
    out = subprocess.run([sys.executable, __file__, *args], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    if out.returncode != 0:
        raise RuntimeError(f"measuring {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def run_measure(size):
    """measure(size) in a fresh interpreter."""
    return in_fresh_process("--measure", json.dumps(size))


def run_loss_backward():
    """measure_loss_backward() in a fresh interpreter: [peak with tv_weight 0, with 1]."""
    return in_fresh_process("--loss-backward")


def drafter_config(size, max_position_embeddings=8192):
    """The DrafterConfig new_drafter makes for write_target's target of `size` (no files)."""
    from eaglenest.drafter.model import DrafterConfig

    s = size_defaults(size)
    return DrafterConfig(target_vocab_size=s["target_vocab"], draft_vocab_size=s["draft_vocab"], hidden_size=s["hidden"],
                         target_hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                         aux_layer_ids=[1, 4, 6], max_position_embeddings=max_position_embeddings, **geometry(s))


def modelled_step(size):
    """(the model's bytes for what measure() sees: its CPU peak minus what is held at the reset,
    the name of the moment of the peak)."""
    s = size_defaults(size)
    # chunk_tokens: TargetHead.distribution's default, which ttt_loss uses
    m = training_memory(drafter_config(s), target_dtype_bytes=2, tokens=s["samples"] * s["longest"],
                        longest=s["longest"], ttt_steps=K, activation_checkpointing=s["checkpointing"],
                        autocast_bf16=s["autocast"], chunk_tokens=4096, stored_dtype_bytes=2,
                        accumulating=s["accumulate"], device="cpu", optimizer=s["optimizer"],
                        train_lm_head=s["train_lm_head"], tv_weight=s["tv_weight"])
    held = sum(m[key] for key in (*BETWEEN_STEPS, "batch_stored")) + (m["gradients"] if s["accumulate"] else 0)
    moment = max((key for key in m if key.startswith("at_")), key=m.get)
    return m["peak"] - held, moment.removeprefix("at_")



def kimi_config(layer="gqa", intermediate_size=None):
    """The DrafterConfig make_drafter_config gives for Kimi-K2.5 (tests/kimi_k25_config.json, its
    published config.json) with a draft vocab of 32,000, config.yaml's drafter: section over the
    target's geometry (the norm flags), as the workflow makes it: the gqa layer at target_geometry's
    default, or (layer "mla") the mla layer at Kimi's MLA with norm_before_fc off (vLLM's layer has
    no input_norm); `intermediate_size` None: config.yaml's, else the layer's default (gqa 12,288;
    mla the target's dense MLP, 18,432)."""
    import torch
    import yaml

    from eaglenest.states.convention import FINAL_STATE_CONVENTION
    from eaglenest.train.init_drafter import make_drafter_config

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text((REPO / "tests" / "kimi_k25_config.json").read_text())
        t2d = torch.zeros(163840, dtype=torch.bool)
        t2d[:KIMI_DRAFT_VOCAB] = True
        manifest = {"hidden_size": 7168, "aux_layer_ids": [2, 30, 58], "final_state": FINAL_STATE_CONVENTION}
        geometry = yaml.safe_load((REPO / "config.yaml").read_text())["drafter"]
        geometry |= {"layer": layer, "intermediate_size": intermediate_size}  # mla: norm_before_fc does not apply
        return make_drafter_config(tmp, manifest, torch.zeros(KIMI_DRAFT_VOCAB, dtype=torch.int64), t2d,
                                   geometry=geometry)


def recipe():
    """config.yaml's train.optimizer, train.train_lm_head and train.tv_weight: the demo's recipe,
    Kimi's default."""
    import yaml

    train = yaml.safe_load((REPO / "config.yaml").read_text())["train"]
    return {key: train[key] for key in ("optimizer", "train_lm_head", "tv_weight")}


def kimi_memory(config, tokens, checkpointing, **kwargs):
    """training_memory for Kimi-K2.5 on a GPU: bf16 target and shards, K = 3, bf16 autocast, one
    sample of `tokens` (the budget), gradients accumulating over micro-batches, the default recipe."""
    return training_memory(config, target_dtype_bytes=2, tokens=tokens, longest=tokens, ttt_steps=K,
                           activation_checkpointing=checkpointing, autocast_bf16=True, **(recipe() | kwargs))


def largest_fitting(peaks, checkpointing):
    """The largest budget whose peak (peaks[checkpointing, budget]) fits GPU_BYTES less MARGIN, or None."""
    fitting = [n for n in KIMI_BUDGETS if peaks[checkpointing, n] <= (1 - MARGIN) * GPU_BYTES]
    return max(fitting, default=None)


def validation_table(sizes):
    """Markdown rows: measured vs modelled step peaks at `sizes`."""
    rows = ["| layer | hidden | heads | vocab V / N | samples × T | compute | ckpt | grads | tv | peak at "
            "| measured MB | model MB | measured / model | s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        s, measured = size_defaults(size), run_measure(size)
        modelled, moment = modelled_step(size)
        rows.append(f"| {s['layer']} | {s['hidden']} | {s['heads']} | {s['target_vocab']:,} / {s['draft_vocab']:,} "
                    f"| {s['samples']} × {s['longest']:,} | {'bf16 autocast' if s['autocast'] else 'float32'} "
                    f"| {'on' if s['checkpointing'] else 'off'} | {'held' if s['accumulate'] else 'fresh'} "
                    f"| {s['tv_weight']:g} | {moment} | {measured['bytes'] / MB:,.0f} | {modelled / MB:,.0f} "
                    f"| {measured['bytes'] / modelled:.3f} | {measured['seconds']:.1f} |")
    return rows


def kimi_layers_table():
    """Markdown rows: the peak per GPU of the README's Kimi-K2.5 run (16,384-token micro-batches,
    activation checkpointing, 8 DDP processes) for each drafter layer: gqa (config.yaml's drafter:
    section, the README's geometry), mla at the README's intermediate_size and at mla's default,
    the target's dense MLP."""
    rows = ["| layer | intermediate_size | trainable parameters | held GB | activations GB | peak GB "
            "| peak with DDP GB | without checkpointing, with DDP GB |", "|---|---|---|---|---|---|---|---|"]
    for layer, intermediate_size in (("gqa", 12288), ("mla", 12288), ("mla", 18432)):
        config = kimi_config(layer, intermediate_size)
        m = kimi_memory(config, 16384, True)
        static = sum(m[key] for key in BETWEEN_STEPS) + m["gradients"] + m["autocast_weights"]
        ddp = {ck: kimi_memory(config, 16384, ck, distributed=True)["peak"] for ck in (True, False)}
        rows.append(f"| {layer} | {config.intermediate_size:,} | {parameter_counts(config, recipe()['train_lm_head'])[0]:,} "
                    f"| {static / GB:.1f} | {m['activations'] / GB:.1f} | {m['peak'] / GB:.1f} | {ddp[True] / GB:.1f} "
                    f"| {ddp[False] / GB:.1f} |")
    return rows


def kimi_table():
    """Markdown rows: the model's Kimi-K2.5 figures per budget, with and without checkpointing.
    "held": weights, gradients, the optimizer's states, the target's tensors, autocast's weight copies."""
    config = kimi_config()
    rows = ["| budget (tokens) | checkpointing | held GB | activations GB | logits + probs GB | attention block GB "
            "| peak GB | peak at | peak with DDP GB | fits 96 GB − 10% |", "|---|---|---|---|---|---|---|---|---|---|"]
    peaks = {}
    for checkpointing in (False, True):
        for n in KIMI_BUDGETS:
            m = kimi_memory(config, n, checkpointing)
            peaks[checkpointing, n] = peak = m["peak"]
            static = sum(m[key] for key in BETWEEN_STEPS) + m["gradients"] + m["autocast_weights"]
            moment = max((key for key in m if key.startswith("at_")), key=m.get).removeprefix("at_")
            ddp = kimi_memory(config, n, checkpointing, distributed=True)["peak"]
            rows.append(f"| {n:,} | {'on' if checkpointing else 'off'} | {static / GB:.1f} | {m['activations'] / GB:.1f} "
                        f"| {(m['logits'] + m['target_probs']) / GB:.1f} | {m['attention_block'] / GB:.1f} "
                        f"| {peak / GB:.1f} | {moment} | {ddp / GB:.1f} "
                        f"| {'yes' if peak <= (1 - MARGIN) * GPU_BYTES else 'no'} |")
    params = parameter_counts(config, recipe()["train_lm_head"])[0]
    rows += ["", f"Kimi-K2.5 drafter: {params:,} trainable parameters. Largest budget within {1 - MARGIN:.0%} of "
             f"{GPU_BYTES / GB:.0f} GB: "
             f"{largest_fitting(peaks, False):,} tokens without checkpointing, "
             f"{largest_fitting(peaks, True):,} with it."]
    # the total variation term's backward (at_backward_tv) against the soft CE alone
    tv = {key: kimi_memory(config, key[1], key[0], tv_weight=1.0) for key in peaks}
    change = max(abs(m["peak"] - kimi_memory(config, n, ck, tv_weight=0.0)["peak"]) for (ck, n), m in tv.items())
    below = min(m["peak"] - m["at_backward_tv"] for m in tv.values())
    rows += ["", f"tv_weight 1 against 0: the peaks differ by at most {change / GB:.1f} GB; the TV backward's "
             f"moment is at least {below / GB:.1f} GB below the peak."]
    return rows


def main(args):
    """All sizes and the Kimi-K2.5 table; `--layer mla`: the mla sizes only; `--kimi-layers`: the
    Kimi-K2.5 peak per layer only."""
    if args[:1] == ["--kimi-layers"]:
        print("\n".join(kimi_layers_table()))
        return
    sizes = TEST_SIZES + MORE_SIZES
    if args[:1] == ["--layer"]:
        print("\n".join(validation_table([size for size in sizes if size_defaults(size)["layer"] == args[1]])))
        return
    print("\n".join(validation_table(sizes)))
    print()
    print("\n".join(kimi_table()))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        print(json.dumps(measure(json.loads(sys.argv[2]))))
    elif sys.argv[1:2] == ["--loss-backward"]:
        print(json.dumps(measure_loss_backward()))
    else:
        main(sys.argv[1:])
