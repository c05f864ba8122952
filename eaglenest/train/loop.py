"""The training loop: an EAGLE-3 drafter trained on packed hidden-state shards with
training-time test (TTT; the loss: eaglenest.train.loss, docs/CONVENTIONS.md "Drafter").

The sample order is a pure function of (seed, epoch) and the loop state is (drafter,
optimizer, scheduler, RNG, Progress), so a killed run resumes from its last periodic
checkpoint (eaglenest.train.resume: restore them, skip the epoch's done batches) and ends as an
uninterrupted one; DDP (eaglenest.train.launch) splits each batch's indices by rank, so the
global batch and the results stay those of one process.
"""

import dataclasses
import logging
import math
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from eaglenest.data.samples import is_heldout
from eaglenest.data.target import target_architectures, target_dtype
from eaglenest.data.vocab import load_vocab
from eaglenest.drafter.export import write_drafter
from eaglenest.states.manifest import read_manifest
from eaglenest.states.shards import ShardSamples, check_shards, collate
from eaglenest.train.init_drafter import new_drafter
from eaglenest.train.launch import launch_workers
from eaglenest.train.loss import global_sum, ttt_loss
from eaglenest.train.resume import CHECKPOINT, read_resume_checkpoint, restore_loop_state, run_key, save_loop_state
from eaglenest.train.target_head import TargetHead
from eaglenest.workflow.atomic import atomic_dir, atomic_path, write_json
from eaglenest.workflow.device import torch_device

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Progress:
    """Where the loop is: saved in every checkpoint beside the weights."""

    step: int = 0
    tokens: int = 0  # supervised tokens trained on, over all processes
    elapsed: float = 0.0  # seconds of training, over every resumed part of the run
    rows: list = dataclasses.field(default_factory=list)  # the training log so far
    window: list = dataclasses.field(default_factory=list)  # [loss, step losses, step accs] per step since the last row


@dataclasses.dataclass
class Run:
    """What the loop trains with, built once by train_drafter."""

    model: torch.nn.Module  # the drafter, DDP-wrapped by train_drafter when distributed
    drafter: torch.nn.Module
    head: TargetHead
    samples: ShardSamples
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    rank: int
    world_size: int
    total_steps: int
    steps_per_epoch: int


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


def log_columns(ttt_steps):
    """The training log's columns."""
    losses = [f"loss_{k}" for k in range(ttt_steps)] + [f"acc_{k}" for k in range(ttt_steps)]
    return ["step", "epoch", "lr", "loss", *losses, "tokens", "elapsed_s"]


def write_tsv(path, columns, rows):
    """The training log: a header, then one line per row; atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as tsv:
            for values in [columns, *rows]:
                tsv.write("\t".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in values))
                tsv.write("\n")


def train_drafter(shard_paths, manifest_path, d2t_path, t2d_path, target_dir, out_dir, log_path, *, seed, ttt_steps,
                  step_weight_decay=0.8, epochs=1, max_steps=None, batch_size=8, lr=1e-4, warmup=0,
                  heldout_fraction=0.0, init_from=None, drafter_geometry=None, max_grad_norm=0.5, log_every=10,
                  verifier_name_or_path=None, export_dtype=None, num_workers=0, device=None,
                  trained_config_path=None, resume_dir=None, checkpoint_every=50, num_processes=1, nnodes=1,
                  launcher=""):
    """Train a drafter; write it to out_dir (speculators format) and a TSV log, atomically.

    Trains max_steps optimizer steps if given, else `epochs` passes over the samples that are
    not held out (see is_heldout). `init_from`: a pre-trained drafter dir, either format (see
    eaglenest.train.init_drafter). `drafter_geometry`: the config's `drafter:` section, DrafterConfig
    fields (num_attention_heads, head_dim, rope_scaling, ...) that replace the defaults unless None.
    The TSV has one row per `log_every` steps: means over those steps of the loss, the step
    losses and the step accuracies (draft argmax = target argmax). Deterministic for a seed on
    CPU. `trained_config_path`: where to write the DrafterConfig as trained (JSON), what the
    pre-flight check and evaluate_vllm hold the export and vLLM's reading of it against.

    `resume_dir`: a directory of training's own (deleted on success). Every checkpoint_every
    steps the loop state goes there; a rerun of the same run (see run_key) resumes from it and
    ends as an uninterrupted run would. `num_processes` > 1: DDP over that many processes
    launched by torchrun (cuda: one GPU each; else gloo on CPU), each batch split across them;
    `nnodes` > 1: spread over that many nodes, one torchrun on each started by `launcher`.
    """
    arguments = dict(locals())  # every argument: for the run key and for torchrun's workers
    distributed = dist.is_available() and dist.is_initialized()
    manifest = read_manifest(manifest_path)
    if not distributed:  # workers come after this check
        check_shards(shard_paths, manifest)
    if num_processes > 1 and not distributed:
        launch_workers(arguments)
        return
    run = start_run(shard_paths, manifest, d2t_path, t2d_path, target_dir, distributed, seed=seed,
                    epochs=epochs, max_steps=max_steps, batch_size=batch_size, lr=lr, warmup=warmup,
                    heldout_fraction=heldout_fraction, init_from=init_from, drafter_geometry=drafter_geometry,
                    device=device)
    this_run = run_key(arguments) if resume_dir else None
    progress = Progress()
    state = read_resume_checkpoint(resume_dir, this_run) if resume_dir else None
    if state is not None:
        restore_loop_state(state, run.drafter, run.optimizer, run.scheduler, run.device)
        progress = Progress(**{field.name: state[field.name] for field in dataclasses.fields(Progress)})
        log.info("resuming from step %d/%d (%s)", progress.step, run.total_steps, resume_dir)
    if distributed:  # after the restore, as DDP starts by broadcasting rank 0's weights
        run.model = DistributedDataParallel(run.drafter, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    train_steps(run, progress, this_run, batch_size=batch_size, seed=seed, ttt_steps=ttt_steps,
                step_weight_decay=step_weight_decay, max_grad_norm=max_grad_norm, log_every=log_every,
                num_workers=num_workers, resume_dir=resume_dir, checkpoint_every=checkpoint_every)
    if run.rank > 0:
        return
    export_trained(run.drafter, target_dir, out_dir, trained_config_path, ttt_steps=ttt_steps,
                   verifier_name_or_path=verifier_name_or_path, export_dtype=export_dtype)
    write_tsv(log_path, log_columns(ttt_steps), progress.rows)
    if resume_dir and Path(resume_dir).exists():
        shutil.rmtree(resume_dir)


def start_run(shard_paths, manifest, d2t_path, t2d_path, target_dir, distributed, *, seed, epochs, max_steps,
              batch_size, lr, warmup, heldout_fraction, init_from, drafter_geometry, device):
    """The Run of train_drafter's arguments: the target head, the training samples, the new
    drafter on its device, AdamW with warmup and cosine decay."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch_device(device)
    d2t, t2d = load_vocab(d2t_path, t2d_path)
    head = TargetHead(target_dir, device)
    samples = ShardSamples(shard_paths, keep=lambda i: not is_heldout(i, heldout_fraction))
    if len(samples) == 0:
        raise ValueError("no training samples left after the held-out split")
    drafter = new_drafter(target_dir, manifest, d2t, t2d, head, seed=seed, init_from=init_from,
                          geometry=drafter_geometry)
    drafter.to(device).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = math.ceil(len(samples) / batch_size)
    total_steps = max_steps if max_steps is not None else epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, total_steps))
    log.info("%d samples, %d steps, device %s, %d processes", len(samples), total_steps, device, world_size)
    return Run(drafter, drafter, head, samples, optimizer, scheduler, device, rank, world_size, total_steps,
               steps_per_epoch)


def epoch_loader(run, batches, num_workers):
    """(this rank's share of each batch, its collated batch) for `batches` of sample indices.

    A rank without a sample of a (last, small) batch takes a masked copy of one: it adds
    nothing but still joins DDP's gradient all-reduce. Own generator: the worker seeds the
    loader draws leave the global RNG (saved in checkpoints) alone."""
    shares = [indices[run.rank :: run.world_size] for indices in batches]
    loader = torch.utils.data.DataLoader(
        run.samples,
        batch_sampler=[share or indices[:1] for share, indices in zip(shares, batches)],
        collate_fn=collate,
        num_workers=num_workers,
        generator=torch.Generator(),
    )
    return zip(shares, loader)


def train_steps(run, progress, this_run, *, batch_size, seed, ttt_steps, step_weight_decay, max_grad_norm,
                log_every, num_workers, resume_dir, checkpoint_every):
    """Optimizer steps from progress.step to run.total_steps, logging every `log_every` steps
    and checkpointing every `checkpoint_every` (rank 0, into resume_dir)."""
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.device.type == "cuda")
    params = [p for p in run.drafter.parameters() if p.requires_grad]
    elapsed_before, start, first_step = progress.elapsed, time.time(), progress.step
    while progress.step < run.total_steps:
        epoch, done = divmod(progress.step, run.steps_per_epoch)  # resumed: skip the epoch's done batches
        batches = epoch_batches(len(run.samples), batch_size, seed, epoch)[done:][: run.total_steps - progress.step]
        for share, batch in epoch_loader(run, batches, num_workers):
            batch = {key: t.to(run.device) for key, t in batch.items()}
            if not share:
                batch["loss_mask"].zero_()
            with autocast:
                loss, value, step_losses, step_accs = ttt_loss(
                    run.model, batch, run.head, run.drafter.t2d, ttt_steps, step_weight_decay, run.world_size
                )
            run.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            run.optimizer.step()
            run.scheduler.step()
            progress.step += 1
            progress.tokens += int(global_sum(batch["loss_mask"].sum(), run.world_size))
            progress.window.append([value, *step_losses, *step_accs])
            progress.elapsed = elapsed_before + time.time() - start
            if progress.step % log_every == 0 or progress.step == run.total_steps:
                log_row(run, progress, epoch, ttt_steps, rate=(progress.step - first_step) / (time.time() - start))
            if resume_dir and run.rank == 0 and progress.step % checkpoint_every == 0 and progress.step < run.total_steps:
                save_loop_state(Path(resume_dir) / CHECKPOINT, run.drafter, run.optimizer, run.scheduler, run.device,
                                run_key=this_run, **dataclasses.asdict(progress))


def log_row(run, progress, epoch, ttt_steps, rate):
    """Close the window: one row of means for the training log, and a progress line (`rate`:
    steps per second in this process)."""
    means = [sum(column) / len(progress.window) for column in zip(*progress.window)]
    progress.window = []
    progress.rows.append([progress.step, epoch, run.scheduler.get_last_lr()[0], *means, progress.tokens,
                          progress.elapsed])
    log.info(
        "step %d/%d epoch %d loss %.4f acc %s | %.2f steps/s %.0f tok/s ETA %.1f min",
        progress.step, run.total_steps, epoch, means[0], " ".join(f"{a:.3f}" for a in means[1 + ttt_steps :]),
        rate, progress.tokens / progress.elapsed, (run.total_steps - progress.step) / rate / 60,
    )


def export_trained(drafter, target_dir, out_dir, trained_config_path, *, ttt_steps, verifier_name_or_path,
                   export_dtype):
    """Write the trained drafter (speculators format) and, if asked, the DrafterConfig it was trained with."""
    # The target's dtype by default: our embed_tokens then equals the target's, and vLLM shares it.
    export_dtype = export_dtype or target_dtype(target_dir) or "bfloat16"
    with atomic_dir(out_dir) as tmp:
        write_drafter(
            drafter,
            tmp,
            verifier_name_or_path=verifier_name_or_path or target_dir,
            verifier_architectures=target_architectures(target_dir) or [],
            speculative_tokens=ttt_steps,
            dtype=getattr(torch, export_dtype),
        )
    if trained_config_path:
        write_json(trained_config_path, drafter.config.to_dict())
