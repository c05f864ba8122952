"""Train an EAGLE-3 drafter on packed hidden-state shards (training-time test, TTT).

Per position p the target's distribution over the next token is
softmax(lm_head(norm(final_hidden_state[p]))) restricted to the draft vocab (t2d) and
renormalised. TTT step k at anchor t predicts x_{t+k+2}, so it learns from the distribution
at p = t+k+1 by soft cross-entropy, weighted step_weight_decay**k, on positions where
x_{t+k+2} was generated (loss_mask), exists, and is the target's argmax inside the draft vocab.

Built for growth: the sample order is a pure function of (seed, epoch) and the loop state is
(drafter, optimizer, scheduler, step, epoch), so resuming from a periodic checkpoint (restore
them, skip the epoch's first batches) and DDP (split each batch's indices by rank, wrap the
drafter) fit without a rewrite.
"""

import hashlib
import json
import logging
import math
import time
from pathlib import Path

import torch
from safetensors import safe_open

from eaglenest.atomic import atomic_dir
from eaglenest.drafter import Drafter, DrafterConfig, RMSNorm
from eaglenest.export import read_checkpoint, write_drafter
from eaglenest.shards import TENSOR_KEYS, ShardSamples
from eaglenest.target import target_architectures, target_config

log = logging.getLogger(__name__)


def is_heldout(sample_id, fraction):
    """Held-out iff a hash of the id falls below `fraction`: no sample ever changes side when
    samples are added, and every stage computes the same split from the id alone."""
    digest = hashlib.sha256(str(sample_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def collate(samples):
    """Right-pad samples into one batch: input_ids [B, T], loss_mask [B, T] (False on padding),
    aux_hidden_states [B, T, 3Ht] and final_hidden_states [B, T, H] as float32."""
    T = max(len(s["input_ids"]) for s in samples)
    batch = {}
    for key in TENSOR_KEYS:
        first = samples[0][key]
        dtype = torch.float32 if first.is_floating_point() else first.dtype
        out = torch.zeros(len(samples), T, *first.shape[1:], dtype=dtype)
        for i, s in enumerate(samples):
            out[i, : len(s[key])] = s[key]
        batch[key] = out
    return batch


def read_target_tensors(target_dir, names):
    """Tensors `names` of a HF checkpoint (model.safetensors or a sharded index), each matched
    exactly or after a prefix (e.g. `language_model.` of multimodal wrappers); absent names
    are left out."""
    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
            weight_map = {key: "model.safetensors" for key in f.keys()}
    tensors = {}
    for name in names:
        matches = [key for key in weight_map if key == name or key.endswith("." + name)]
        if name in matches:
            matches = [name]
        if len(matches) > 1:
            raise ValueError(f"{name} is ambiguous in {target_dir}: {matches}")
        if matches:
            with safe_open(str(target_dir / weight_map[matches[0]]), framework="pt") as f:
                tensors[name] = f.get_tensor(matches[0])
    return tensors


class TargetHead:
    """The target's embed_tokens, final norm and lm_head (float32), read from its checkpoint."""

    def __init__(self, target_dir, device="cpu"):
        text_config = target_config(target_dir)
        names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
        tensors = read_target_tensors(target_dir, names)
        self.embed_tokens = tensors["model.embed_tokens.weight"].float().to(device)  # [V, H]
        if "lm_head.weight" in tensors:
            self.lm_head = tensors["lm_head.weight"].float().to(device)  # [V, H]
        elif text_config.get("tie_word_embeddings", False):
            self.lm_head = self.embed_tokens
        else:
            raise ValueError(f"{target_dir} has no lm_head.weight and untied embeddings")
        hidden_size = self.embed_tokens.shape[1]
        self.norm = RMSNorm(hidden_size, text_config.get("rms_norm_eps", 1e-6)).to(device)
        self.norm.weight.data = tensors["model.norm.weight"].float().to(device)

    @torch.no_grad()
    def distribution(self, final_hidden, t2d, chunk_tokens=4096):
        """final_hidden [B, T, H] (pre-norm) -> (probs over the draft vocab [B, T, N],
        in_vocab [B, T]: the target's argmax over the whole vocab is a draft token).
        Chunked over tokens so [tokens, V] logits never exist at once."""
        B, T, _ = final_hidden.shape
        probs, in_vocab = [], []
        with torch.autocast(final_hidden.device.type, enabled=False):  # argmax ties: stay fp32
            for x in final_hidden.flatten(0, 1).split(chunk_tokens):
                logits = self.norm(x) @ self.lm_head.T  # [n, V]
                in_vocab.append(t2d[logits.argmax(-1)])
                probs.append(logits[:, t2d].softmax(-1))
        return torch.cat(probs).view(B, T, -1), torch.cat(in_vocab).view(B, T)


def load_vocab(d2t_path, t2d_path):
    """d2t (int64 offsets [N]) and t2d (bool [V]) saved with torch.save; checks they agree."""
    d2t = torch.load(d2t_path, weights_only=True).to(torch.int64)
    t2d = torch.load(t2d_path, weights_only=True).to(torch.bool)
    if not torch.equal(torch.arange(len(d2t)) + d2t, t2d.nonzero().flatten()):
        raise ValueError("d2t and t2d disagree: target id i + d2t[i] must list t2d's ids in order")
    return d2t, t2d


def make_drafter_config(target_dir, manifest, d2t, t2d, init_config=None, geometry=None):
    """Drafter geometry: the target's attention/MLP sizes, replaced by those of an init_from
    checkpoint (whose weights must fit), replaced by explicit `geometry` overrides.
    hidden_size is the target's (the drafter embeds with the target's embed_tokens)."""
    tc = target_config(target_dir)
    hidden_size, heads = tc["hidden_size"], tc["num_attention_heads"]
    if manifest["hidden_size"] != hidden_size or manifest.get("final_state") != "pre_norm":
        raise ValueError("shards do not match the target: hidden size or final state convention")
    rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    shape = {
        "intermediate_size": tc["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": tc.get("num_key_value_heads") or heads,
        "head_dim": tc.get("head_dim") or hidden_size // heads,
        "rms_norm_eps": tc.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope.get("rope_theta", tc.get("rope_theta", 10000.0))),
        "max_position_embeddings": tc.get("max_position_embeddings", 32768),
        "norm_before_residual": False,
    }
    if init_config is not None:
        if (init_config.hidden_size, init_config.target_vocab_size) != (hidden_size, len(t2d)):
            raise ValueError("init_from drafter was made for a target of another size")
        shape.update({key: getattr(init_config, key) for key in shape if key != "rope_theta"})
    shape.update(geometry or {})
    return DrafterConfig(
        target_vocab_size=len(t2d),
        draft_vocab_size=len(d2t),
        hidden_size=hidden_size,
        target_hidden_size=hidden_size,
        aux_layer_ids=list(manifest["aux_layer_ids"]),
        **shape,
    )


def init_from_checkpoint(drafter, state, target_lm_head):
    """Load a pre-trained drafter's weights (`state`, speculators names) into `drafter`.

    The draft vocabs may differ: our lm_head row for target id x is their row for x when x is
    in both vocabs, else the target lm_head row of x. embed_tokens stays the target's.
    """
    own = drafter.state_dict()
    for name in own:
        if name in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
            continue
        if name not in state or state[name].shape != own[name].shape:
            raise ValueError(f"init_from: {name} missing or of another shape")
        own[name].copy_(state[name])
    V = drafter.config.target_vocab_size
    our_ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))
    their_ids = torch.arange(len(state["d2t"])) + state["d2t"]
    their_row = torch.full((V,), -1, dtype=torch.int64)
    their_row[their_ids] = torch.arange(len(their_ids))
    rows = their_row[our_ids]
    lm_head = target_lm_head[our_ids].clone()
    lm_head[rows >= 0] = state["lm_head.weight"][rows[rows >= 0]].to(lm_head.dtype)
    own["lm_head.weight"].copy_(lm_head)
    return int((rows >= 0).sum())


def ttt_loss(drafter, batch, head, num_steps, step_weight_decay):
    """Weighted TTT loss -> (loss, per-step mean losses, per-step accuracies vs the target's
    argmax), each step averaged over its supervised positions."""
    probs, in_vocab = head.distribution(batch["final_hidden_states"], drafter.t2d)  # [B, T, N]
    logits = drafter(batch["input_ids"], batch["aux_hidden_states"], num_steps)
    T = batch["input_ids"].shape[1]
    loss, step_losses, step_accs = 0.0, [], []
    for k, step_logits in enumerate(logits):
        n = max(T - k - 2, 0)  # anchors t whose predicted token x_{t+k+2} is in the batch
        target = probs[:, k + 1 : k + 1 + n]  # target's distribution of x_{t+k+2}
        mask = batch["loss_mask"][:, k + 2 :] & in_vocab[:, k + 1 : k + 1 + n]
        step_logits = step_logits[:, :n]
        ce = -(target * step_logits.log_softmax(-1)).sum(-1)  # [B, n]
        count = mask.sum()
        step_loss = (ce * mask).sum() / count.clamp(min=1)
        correct = (step_logits.argmax(-1) == target.argmax(-1)) & mask
        loss = loss + step_weight_decay**k * step_loss
        step_losses.append(step_loss.item())
        step_accs.append(correct.sum().item() / max(count.item(), 1))
    return loss, step_losses, step_accs


def epoch_batches(num_samples, batch_size, seed, epoch):
    """Shuffled batches of sample indices, a pure function of (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed + 1_000_003 * epoch)
    order = torch.randperm(num_samples, generator=generator).tolist()
    return [order[i : i + batch_size] for i in range(0, num_samples, batch_size)]


def lr_factor(step, warmup, total_steps):
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total_steps`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total_steps - warmup, 1)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_drafter(
    shard_paths,
    manifest_path,
    d2t_path,
    t2d_path,
    target_dir,
    out_dir,
    log_path,
    *,
    seed,
    ttt_steps,
    step_weight_decay=0.8,
    epochs=1,
    max_steps=None,
    batch_size=8,
    lr=1e-4,
    warmup=0,
    heldout_fraction=0.0,
    init_from=None,
    drafter_geometry=None,
    max_grad_norm=0.5,
    log_every=10,
    verifier_name_or_path=None,
    export_dtype=None,
    num_workers=0,
    device=None,
):
    """Train a drafter; write it to out_dir (speculators format, atomically) and a TSV log.

    Trains max_steps optimizer steps if given, else `epochs` passes over the samples that are
    not held out (see is_heldout). `init_from`: a pre-trained drafter dir, speculators or
    EAGLE/SGLang format; its geometry and norm_before_residual are kept, and its lm_head rows
    are mapped by target token id when its d2t differs from ours (rows of ids in both vocabs
    copied, the others from the target lm_head). Without it, lm_head starts as the target
    lm_head rows of the draft vocab. `drafter_geometry`: DrafterConfig field overrides
    (intermediate_size, num_attention_heads, num_key_value_heads, head_dim, ...).
    The TSV has one row per `log_every` steps: means over those steps of the loss, the step
    losses and the step accuracies (draft argmax = target argmax). Deterministic for a seed on
    CPU. Returns the last row as a dict.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    manifest = json.loads(Path(manifest_path).read_text())
    d2t, t2d = load_vocab(d2t_path, t2d_path)
    head = TargetHead(target_dir, device)
    samples = ShardSamples(shard_paths, keep=lambda i: not is_heldout(i, heldout_fraction))
    if len(samples) == 0:
        raise ValueError("no training samples left after the held-out split")

    init_config = init_state = None
    if init_from is not None:
        init_config, init_state = read_checkpoint(init_from, require_plain_rope=False)
    config = make_drafter_config(target_dir, manifest, d2t, t2d, init_config, drafter_geometry)
    torch.manual_seed(seed)
    drafter = Drafter(config)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    drafter.embed_tokens.weight.data.copy_(head.embed_tokens)
    if init_state is not None:
        shared = init_from_checkpoint(drafter, init_state, head.lm_head.cpu())
        log.info("init_from %s: %d/%d lm_head rows reused", init_from, shared, len(d2t))
    else:
        draft_ids = drafter.draft_to_target(torch.arange(len(d2t)))
        drafter.lm_head.weight.data.copy_(head.lm_head[draft_ids])
    drafter.to(device).train()

    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = math.ceil(len(samples) / batch_size)
    total_steps = max_steps if max_steps is not None else epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, total_steps)
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    columns = ["step", "epoch", "lr", "loss"]
    columns += [f"loss_{k}" for k in range(ttt_steps)] + [f"acc_{k}" for k in range(ttt_steps)]
    columns += ["tokens", "elapsed_s"]
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log.info("%d samples, %d steps, device %s", len(samples), total_steps, device)

    start, tokens, step, epoch, record = time.time(), 0, 0, 0, None
    window = []  # per step [loss, step losses..., step accuracies...] since the last log line
    with open(log_path, "w") as tsv:
        tsv.write("\t".join(columns) + "\n")
        while step < total_steps:
            batches = epoch_batches(len(samples), batch_size, seed, epoch)[: total_steps - step]
            loader = torch.utils.data.DataLoader(
                samples, batch_sampler=batches, collate_fn=collate, num_workers=num_workers
            )
            for batch in loader:
                batch = {key: t.to(device) for key, t in batch.items()}
                with autocast:
                    loss, step_losses, step_accs = ttt_loss(
                        drafter, batch, head, ttt_steps, step_weight_decay
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                optimizer.step()
                scheduler.step()
                step += 1
                tokens += int(batch["loss_mask"].sum())
                window.append([loss.item(), *step_losses, *step_accs])
                if step % log_every and step != total_steps:
                    continue

                elapsed = time.time() - start
                means = [sum(column) / len(window) for column in zip(*window)]
                window = []
                values = [step, epoch, scheduler.get_last_lr()[0], *means, tokens, elapsed]
                record = dict(zip(columns, values))
                tsv.write("\t".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in values))
                tsv.write("\n")
                tsv.flush()
                rate = step / elapsed
                log.info(
                    "step %d/%d epoch %d loss %.4f acc %s | %.2f steps/s %.0f tok/s ETA %.1f min",
                    step, total_steps, epoch, means[0],
                    " ".join(f"{a:.3f}" for a in means[1 + ttt_steps :]),
                    rate, tokens / elapsed, (total_steps - step) / rate / 60,
                )
            epoch += 1

    architectures = target_architectures(target_dir)
    # The target's dtype by default: our embed_tokens then equals the target's, and vLLM shares it.
    tc = target_config(target_dir)
    export_dtype = export_dtype or tc.get("dtype") or tc.get("torch_dtype") or "bfloat16"
    with atomic_dir(out_dir) as tmp:
        write_drafter(
            drafter,
            tmp,
            verifier_name_or_path=verifier_name_or_path or target_dir,
            verifier_architectures=architectures or [],
            speculative_tokens=ttt_steps,
            dtype=getattr(torch, export_dtype),
        )
    return record
