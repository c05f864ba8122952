"""Train an EAGLE-3 drafter on packed hidden-state shards (training-time test, TTT).

Per position p the target's distribution over the next token is
softmax(lm_head(norm(final_hidden_state[p]))) restricted to the draft vocab (t2d) and
renormalised. TTT step k at anchor t predicts x_{t+k+2}, so it learns from the distribution
at p = t+k+1 by soft cross-entropy, weighted step_weight_decay**k, on positions where
x_{t+k+2} was generated (loss_mask), exists, and is the target's argmax inside the draft vocab.

The sample order is a pure function of (seed, epoch) and the loop state is (drafter,
optimizer, scheduler, RNG, step, log rows), so a killed run resumes from its last periodic
checkpoint (restore them, skip the epoch's done batches) and ends as an uninterrupted one; DDP
splits each batch's indices by rank, so the global batch and the results stay those of one
process.
"""

import ctypes
import hashlib
import json
import logging
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.nn.parallel import DistributedDataParallel

from eaglenest.atomic import atomic_dir, atomic_path, save_torch, write_json
from eaglenest.drafter import Drafter, DrafterConfig, RMSNorm
from eaglenest.export import read_checkpoint, write_drafter
from eaglenest.fingerprint import code_fingerprint
from eaglenest.shards import TENSOR_KEYS, ShardSamples, check_shards
from eaglenest.stage import InputError
from eaglenest.target import target_architectures, target_config

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the folder holding this eaglenest
CHECKPOINT = "checkpoint.pt"  # in resume_dir
PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None  # resolved before any fork
PR_SET_PDEATHSIG = 1
RDZV_PORT = 29500  # multi-node: torchrun's rendezvous on the node that launches the others


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
        if init_config.aux_layer_ids is not None and list(init_config.aux_layer_ids) != list(manifest["aux_layer_ids"]):
            raise InputError(
                f"init_from drafter was trained on aux layers {init_config.aux_layer_ids}, the hidden states "
                f"hold {manifest['aux_layer_ids']}: set hidden_states.aux_layer_ids to {init_config.aux_layer_ids}"
            )
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


def global_sum(tensor, world_size):
    """`tensor` summed in place over the DDP ranks (unchanged with one process)."""
    if world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def ttt_loss(model, batch, head, t2d, num_steps, step_weight_decay, world_size=1):
    """Weighted TTT loss -> (loss to backpropagate, its value, per-step mean losses, per-step
    accuracies vs the target's argmax), each step averaged over its supervised positions.

    The means are over the global batch: with DDP each rank divides its sums by the counts of
    all ranks and scales by world_size, so DDP's gradient average is one process's gradient."""
    probs, in_vocab = head.distribution(batch["final_hidden_states"], t2d)  # [B, T, N]
    logits = model(batch["input_ids"], batch["aux_hidden_states"], num_steps)
    T = batch["input_ids"].shape[1]
    ce_sums, stats = [], []
    for k, step_logits in enumerate(logits):
        n = max(T - k - 2, 0)  # anchors t whose predicted token x_{t+k+2} is in the batch
        target = probs[:, k + 1 : k + 1 + n]  # target's distribution of x_{t+k+2}
        mask = batch["loss_mask"][:, k + 2 :] & in_vocab[:, k + 1 : k + 1 + n]
        step_logits = step_logits[:, :n]
        ce = -(target * step_logits.log_softmax(-1)).sum(-1)  # [B, n]
        correct = (step_logits.argmax(-1) == target.argmax(-1)) & mask
        ce_sums.append((ce * mask).sum())
        stats.append(torch.stack([ce_sums[-1].detach(), mask.sum(), correct.sum()]).double())
    ce_total, counts, corrects = global_sum(torch.stack(stats), world_size).T.tolist()
    counts = [max(count, 1) for count in counts]
    loss = 0.0
    for k, (ce_sum, count) in enumerate(zip(ce_sums, counts)):
        loss = loss + step_weight_decay**k * (ce_sum / count)
    step_losses = [c / count for c, count in zip(ce_total, counts)]
    value = sum(step_weight_decay**k * step_loss for k, step_loss in enumerate(step_losses))
    step_accs = [c / count for c, count in zip(corrects, counts)]
    return loss * world_size, value, step_losses, step_accs


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


# Arguments that leave what training computes unchanged: a checkpoint stays valid across them.
NOT_IN_RUN_KEY = (
    "out_dir", "log_path", "trained_config_path", "resume_dir", "checkpoint_every", "num_processes", "num_workers",
    "device", "verifier_name_or_path", "export_dtype", "nnodes", "launcher",
)


def run_key(arguments):
    """Hash of everything that determines a training run: its settings, the data (the manifest
    holds each shard's sha256), the vocab maps, the target's config, the init_from path and the
    training code. A checkpoint with another key belongs to another run."""
    key = {name: value for name, value in arguments.items() if name not in NOT_IN_RUN_KEY}
    key["shard_paths"] = [Path(path).name for path in arguments["shard_paths"]]
    key["manifest_path"] = Path(arguments["manifest_path"]).read_text()
    # by content: the bytes torch.save writes also hold the file's name
    d2t, t2d = load_vocab(key.pop("d2t_path"), key.pop("t2d_path"))
    key["vocab"] = hashlib.sha256(d2t.numpy().tobytes() + t2d.numpy().tobytes()).hexdigest()
    key["target_dir"] = target_config(arguments["target_dir"])
    key["code"] = code_fingerprint(PACKAGE_ROOT, "eaglenest/train.py")
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def read_resume_checkpoint(resume_dir, key):
    """The checkpoint in resume_dir if it was written by the run with this key, else None."""
    path = Path(resume_dir) / CHECKPOINT
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["run_key"] != key:
        log.info("ignoring the stale checkpoint %s (of other settings, data or code)", path)
        return None
    return state


def save_loop_state(path, drafter, optimizer, scheduler, device, **progress):
    """Checkpoint the loop state: weights (but the frozen embed_tokens, the target's), optimizer,
    scheduler, RNG, and `progress` (run_key, step, tokens, elapsed, log rows, window)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    weights = {n: t for n, t in drafter.state_dict().items() if n != "embed_tokens.weight"}
    save_torch(path, {
        "drafter": weights, "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "rng": rng, **progress,
    })


def restore_loop_state(state, drafter, optimizer, scheduler, device):
    """Load a save_loop_state checkpoint into the loop's objects and the RNG."""
    drafter.load_state_dict(state["drafter"], strict=False)  # all but embed_tokens
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if device.type == "cuda" and "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)


def training_device(device):
    """`device`, by default cuda when available, else cpu; under torchrun the cuda device of
    this process's LOCAL_RANK."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def die_with_parent():
    """Have the kernel SIGKILL this process when its parent dies (Linux): a killed job leaves
    no torchrun or DDP worker training on (torchrun starts its workers in sessions of their
    own, out of reach of a kill of the job's process group)."""
    if PRCTL is not None:
        PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def torchrun_command(arguments_path, num_processes, nnodes=1, launcher="", rdzv_endpoint=None, rdzv_id=None):
    """The command that starts num_processes training processes: one torchrun on this node
    (--standalone), or with nnodes > 1 one torchrun on each node with num_processes / nnodes
    processes, all started by `launcher` (e.g. "srun", which in a SLURM job of `nodes` nodes and
    as many tasks starts one on each node), meeting at `rdzv_endpoint` (host:port of this node,
    where torchrun's c10d store runs)."""
    if num_processes % nnodes:
        raise InputError(f"train.num_processes {num_processes} is not a multiple of the {nnodes} nodes")
    if nnodes > 1 and not launcher:
        raise InputError(f"{nnodes} nodes need a launcher that starts torchrun on each (resource mpi, e.g. srun)")
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        torchrun.append("--standalone")
    else:
        torchrun += [
            f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
        ]
    return [
        *shlex.split(launcher), *torchrun, f"--nproc-per-node={num_processes // nnodes}", "-m", "eaglenest.train",
        str(arguments_path),
    ]


def launch_workers(arguments):
    """Run train_drafter in num_processes processes with torchrun, on this node or spread evenly
    over `nnodes` nodes (see torchrun_command), each running `python -m eaglenest.train ARGS`.
    The workers' output goes to this process's log."""
    # beside the log: on the file system the job writes to (a multi-node one shares it), and
    # replaced, not piled up, by a rerun after a kill
    log_path = Path(arguments["log_path"])
    path = log_path.with_name(f".{log_path.name}.torchrun.json")
    command = torchrun_command(
        path, arguments["num_processes"], arguments["nnodes"], arguments["launcher"],
        f"{socket.gethostname()}:{RDZV_PORT}", os.environ.get("SLURM_JOB_ID", os.getpid()),
    )
    n = arguments["num_processes"] // arguments["nnodes"]  # processes on this node
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(max(1, torch.get_num_threads() // n)),  # share this job's threads
        # the workers import this very eaglenest: not one in the working directory (safe path),
        # nor an installed copy of another checkout
        PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONSAFEPATH="1",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(arguments, default=str))
    log.info("launching %d processes on each of %d nodes: %s", n, arguments["nnodes"], shlex.join(command))
    try:
        with subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=die_with_parent,
        ) as workers:
            for line in workers.stdout:
                log.info("%s", line.rstrip())
    finally:
        path.unlink()
    if workers.returncode:
        raise RuntimeError(f"torchrun exited with status {workers.returncode} (output above)")


def write_tsv(path, columns, rows):
    """The training log: a header, then one line per row; atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as tsv:
            for values in [columns, *rows]:
                tsv.write("\t".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in values))
                tsv.write("\n")


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
    trained_config_path=None,
    resume_dir=None,
    checkpoint_every=50,
    num_processes=1,
    nnodes=1,
    launcher="",
):
    """Train a drafter; write it to out_dir (speculators format) and a TSV log, atomically.

    Trains max_steps optimizer steps if given, else `epochs` passes over the samples that are
    not held out (see is_heldout). `init_from`: a pre-trained drafter dir, speculators or
    EAGLE/SGLang format; its geometry and norm_before_residual are kept, and its lm_head rows
    are mapped by target token id when its d2t differs from ours (rows of ids in both vocabs
    copied, the others from the target lm_head). Without it, lm_head starts as the target
    lm_head rows of the draft vocab. `drafter_geometry`: DrafterConfig field overrides
    (intermediate_size, num_attention_heads, num_key_value_heads, head_dim, ...).
    The TSV has one row per `log_every` steps: means over those steps of the loss, the step
    losses and the step accuracies (draft argmax = target argmax). Deterministic for a seed on
    CPU.

    `trained_config_path`: where to write the DrafterConfig as trained (JSON), what the
    pre-flight check and evaluate_vllm hold the export and vLLM's reading of it against.

    `resume_dir`: a directory of training's own (deleted on success). Every checkpoint_every
    steps the loop state goes there; a rerun of the same run (see run_key) resumes from it and
    ends as an uninterrupted run would. `num_processes` > 1: DDP over that many processes
    launched by torchrun (cuda: one GPU each; else gloo on CPU), each batch split across them;
    `nnodes` > 1: spread over that many nodes, one torchrun on each started by `launcher`.
    """
    arguments = dict(locals())  # every argument: for the run key and for torchrun's workers
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:  # workers come after this check
        check_shards(shard_paths, json.loads(Path(manifest_path).read_text()))
    if num_processes > 1 and not distributed:
        launch_workers(arguments)
        return
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = training_device(device)
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
    log.info(
        "%d samples, %d steps, device %s, %d processes",
        len(samples), total_steps, device, world_size,
    )

    step, tokens, elapsed_before, rows = 0, 0, 0.0, []
    window = []  # per step [loss, step losses..., step accuracies...] since the last log line
    this_run = run_key(arguments) if resume_dir else None
    state = read_resume_checkpoint(resume_dir, this_run) if resume_dir else None
    if state is not None:
        restore_loop_state(state, drafter, optimizer, scheduler, device)
        step, tokens, elapsed_before = state["step"], state["tokens"], state["elapsed"]
        rows, window = state["rows"], state["window"]
        log.info("resuming from step %d/%d (%s)", step, total_steps, resume_dir)
    model = drafter
    if distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(drafter, device_ids=device_ids)

    start, first_step = time.time(), step
    while step < total_steps:
        epoch, done = divmod(step, steps_per_epoch)  # resumed: skip the epoch's done batches
        batches = epoch_batches(len(samples), batch_size, seed, epoch)[done:][: total_steps - step]
        shares = [indices[rank::world_size] for indices in batches]
        # A rank without a sample of a (last, small) batch takes a masked copy of one: it adds
        # nothing but still joins DDP's gradient all-reduce. Own generator: the worker seeds
        # the loader draws leave the global RNG (saved in checkpoints) alone.
        loader = torch.utils.data.DataLoader(
            samples,
            batch_sampler=[share or indices[:1] for share, indices in zip(shares, batches)],
            collate_fn=collate,
            num_workers=num_workers,
            generator=torch.Generator(),
        )
        for share, batch in zip(shares, loader):
            batch = {key: t.to(device) for key, t in batch.items()}
            if not share:
                batch["loss_mask"].zero_()
            with autocast:
                loss, value, step_losses, step_accs = ttt_loss(
                    model, batch, head, drafter.t2d, ttt_steps, step_weight_decay, world_size
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            tokens += int(global_sum(batch["loss_mask"].sum(), world_size))
            window.append([value, *step_losses, *step_accs])
            elapsed = elapsed_before + time.time() - start
            if step % log_every == 0 or step == total_steps:
                means = [sum(column) / len(window) for column in zip(*window)]
                window = []
                rows.append([step, epoch, scheduler.get_last_lr()[0], *means, tokens, elapsed])
                rate = (step - first_step) / (time.time() - start)
                log.info(
                    "step %d/%d epoch %d loss %.4f acc %s | %.2f steps/s %.0f tok/s ETA %.1f min",
                    step, total_steps, epoch, means[0],
                    " ".join(f"{a:.3f}" for a in means[1 + ttt_steps :]),
                    rate, tokens / elapsed, (total_steps - step) / rate / 60,
                )
            if resume_dir and rank == 0 and step % checkpoint_every == 0 and step < total_steps:
                save_loop_state(
                    Path(resume_dir) / CHECKPOINT, drafter, optimizer, scheduler, device,
                    run_key=this_run, step=step, tokens=tokens, elapsed=elapsed,
                    rows=rows, window=window,
                )
    if rank > 0:
        return

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
    if trained_config_path:
        write_json(trained_config_path, drafter.config.to_dict())
    write_tsv(log_path, columns, rows)
    if resume_dir and Path(resume_dir).exists():
        shutil.rmtree(resume_dir)


def main(arguments_path):
    """torchrun's entry: this process's rank of train_drafter, arguments from a JSON file."""
    die_with_parent()
    arguments = json.loads(Path(arguments_path).read_text())
    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"rank {rank} %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    device = training_device(arguments.pop("device"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        train_drafter(**arguments, device=str(device))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
