"""The training loop: an EAGLE-3 drafter trained on packed hidden-state shards with
training-time test (TTT; the loss: eaglenest.train.loss, docs/TRAINING.md "The drafter").

Batches go by token budget (eaglenest.train.batches): micro-batches of similar lengths within
train.max_tokens_per_batch padded tokens, and an optimizer step accumulates the gradients of
consecutive ones until they hold train.tokens_per_step supervised tokens. The step lists are a
pure function of (data, budgets, seed, epoch) and the loop state is (drafter, optimizer,
scheduler, RNG, Progress), so a killed run resumes from its last periodic checkpoint
(eaglenest.train.resume: restore them, skip the done optimizer steps) and ends as an
uninterrupted one; with DDP (eaglenest.train.launch) the ranks take turns of each step's
micro-batches, so the global batch and the results stay those of one process.
"""

import contextlib
import dataclasses
import functools
import itertools
import logging
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.nn.parallel import DistributedDataParallel

from eaglenest.data.samples import is_heldout
from eaglenest.data.target import target_architectures, target_dtype
from eaglenest.data.vocab import load_vocab
from eaglenest.drafter.export import write_drafter
from eaglenest.states.manifest import read_manifest
from eaglenest.states.shards import ShardSamples, check_shards, collate, dequantize_states
from eaglenest.train.batches import epoch_steps, rank_rounds, step_normalisers
from eaglenest.train.init_drafter import new_drafter
from eaglenest.train.launch import launch_workers
from eaglenest.train.loss import MASK_OFFSET, global_sum, step_means, ttt_loss
from eaglenest.train.optim import Optimizers, build_optimizers
from eaglenest.train.resume import CHECKPOINT, read_resume_checkpoint, restore_loop_state, run_key, save_loop_state
from eaglenest.drafter.target_head import TargetHead
from eaglenest.workflow.atomic import atomic_dir, atomic_path, write_json
from eaglenest.workflow.device import torch_device
from eaglenest.workflow.progress import ProgressLines
from eaglenest.workflow.tracking import open_trackers

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Progress:
    """Where the loop is: saved in every checkpoint beside the weights."""

    step: int = 0
    tokens: int = 0  # supervised tokens trained on, over all processes
    elapsed: float = 0.0  # seconds of training, over every resumed part of the run
    rows: list = dataclasses.field(default_factory=list)  # the training log so far
    window: list = dataclasses.field(default_factory=list)  # window_columns' values per step since the last row


@dataclasses.dataclass
class Run:
    """What the loop trains with, built once by train_drafter."""

    model: torch.nn.Module  # the drafter, DDP-wrapped by train_drafter when distributed
    drafter: torch.nn.Module
    head: TargetHead
    samples: ShardSamples
    optimizer: Optimizers  # with their learning-rate schedules
    device: torch.device
    rank: int
    world_size: int
    total_steps: int
    plan: object  # epoch -> its optimizer steps, each a list of micro-batches of sample indices
    supervised: list  # per sample: its supervised (loss_mask) tokens
    counts: list  # per sample: the positions TTT step k supervises, k < ttt_steps


def supervision(samples, ttt_steps, mask_alignment="predicted"):
    """(supervised tokens, [positions TTT step k supervises for each k]) per sample, from the
    shards' loss_mask alone: a step's token count and loss normalisers are known before any of
    its micro-batches is loaded. One shard's mask in memory at a time. `mask_alignment`: see
    eaglenest.train.loss.soft_ce_loss."""
    offset = MASK_OFFSET[mask_alignment]
    supervised, counts = [], []
    for path, entries in itertools.groupby(samples.index, key=lambda entry: entry[0]):
        starts, ends = torch.tensor([[start, end] for _, start, end, _ in entries]).T
        with safe_open(path, framework="pt") as f:
            cumulative = torch.cat([torch.zeros(1, dtype=torch.int64), f.get_tensor("loss_mask").cumsum(0)])
        supervised += (cumulative[ends] - cumulative[starts]).tolist()
        shifted = torch.minimum(starts[:, None] + torch.arange(1 + offset, ttt_steps + 1 + offset),
                                ends[:, None])  # x_{t+k+1+offset}
        counts += (cumulative[ends][:, None] - cumulative[shifted]).tolist()
    return supervised, counts


def window_columns(ttt_steps):
    """What each optimizer step measures: the weighted loss, the TTT steps' losses, accuracies
    and agreements, the gradients' norm before clipping. A log row holds their means."""
    steps = [f"{name}_{k}" for name in ("loss", "acc", "agreement") for k in range(ttt_steps)]
    return ["loss", *steps, "grad_norm"]


def log_columns(ttt_steps):
    """The training log's columns."""
    return ["step", "epoch", "lr", *window_columns(ttt_steps), "tokens", "elapsed_s"]


def write_tsv(path, columns, rows):
    """The training log: a header, then one line per row; atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as tsv:
            for values in [columns, *rows]:
                tsv.write("\t".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in values))
                tsv.write("\n")


def train_drafter(shard_paths, manifest_path, d2t_path, t2d_path, target_dir, out_dir, log_path, *, seed, ttt_steps,
                  step_weight_decay=0.8, epochs=1, max_steps=None, max_tokens_per_batch=8192, tokens_per_step=8192,
                  lr=1e-4, warmup=0, warmup_from_zero=False, schedule="cosine", optimizer="adamw", weight_decay=0.0,
                  muon_lr=None, muon_weight_decay=0.1, adamw_betas=(0.9, 0.95), max_grad_norm=0.5,
                  supervise="in_draft_vocab", mask_alignment="predicted", length_sorted=True, packed_steps=False,
                  temperature=1.0, tv_weight=0.0, train_lm_head=True, init_std=None, heldout_fraction=0.0,
                  init_from=None, drafter_geometry=None, log_every=10, verifier_name_or_path=None, export_dtype=None,
                  num_workers=0, pin_memory=False, activation_checkpointing=False, bf16=None, device=None,
                  trained_config_path=None, resume_dir=None, checkpoint_every=50, num_processes=1, nnodes=1,
                  launcher="", tracking=None):
    """Train a drafter; write it to out_dir (speculators format) and a TSV log, atomically.

    Trains max_steps optimizer steps if given, else `epochs` passes over the samples that are
    not held out (see is_heldout), batched by token budget (max_tokens_per_batch padded tokens a
    micro-batch, tokens_per_step supervised tokens an optimizer step: eaglenest.train.batches).
    `init_from`: a pre-trained drafter dir, either format (see eaglenest.train.init_drafter).
    `drafter_geometry`: the config's `drafter:` section, DrafterConfig fields
    (num_attention_heads, head_dim, rope_scaling, ...) that replace the defaults unless None.
    The TSV has one row per `log_every` steps: means over those steps of the loss, the step
    losses, the step accuracies (draft argmax = target argmax) and the step agreements (sum_x
    min(p, q), what probabilistic drafting accepts at its first position). Deterministic for a
    seed on CPU. `trained_config_path`: where to write the DrafterConfig as trained (JSON), what the
    pre-flight check and evaluate_vllm hold the export and vLLM's reading of it against.

    The recipe, each setting explained in docs/RECIPE.md: `optimizer`, `lr`, `muon_lr` (None: lr),
    `weight_decay`, `muon_weight_decay`, `adamw_betas` (eaglenest.train.optim); `schedule`, `warmup`,
    `warmup_from_zero`, `max_grad_norm`; `supervise`, `mask_alignment`, `temperature` (resolved before:
    eaglenest.workflow.serving.fitted_temperature) and `tv_weight` (eaglenest.train.loss); `length_sorted`,
    `packed_steps` (eaglenest.train.batches); `init_std`, `train_lm_head` (False: the target's rows, frozen).

    `resume_dir`: a directory of training's own (deleted on success). Every checkpoint_every
    steps the loop state goes there; a rerun of the same run (see run_key) resumes from it and
    ends as an uninterrupted run would. `num_processes` > 1: DDP over that many processes
    launched by torchrun (cuda: one GPU each; else gloo on CPU), taking turns of each step's
    micro-batches; `nnodes` > 1: spread over that many nodes, one torchrun on each started by
    `launcher`.
    Speed only: `num_workers` DataLoader workers, `pin_memory` (cuda), `activation_checkpointing`
    (the drafter recomputes its activations in backward), `bf16` (autocast; None: on cuda only).
    Observability only: `tracking`, the config's tracking section (None: none; see train_steps).
    """
    arguments = dict(locals())  # every argument: for the run key and for torchrun's workers
    distributed = dist.is_available() and dist.is_initialized()
    manifest = read_manifest(manifest_path)
    if not distributed:  # workers come after this check
        check_shards(shard_paths, manifest)
    if num_processes > 1 and not distributed:
        launch_workers(arguments)
        return
    run = start_run(shard_paths, manifest, d2t_path, t2d_path, target_dir, distributed, seed=seed, ttt_steps=ttt_steps,
                    epochs=epochs, max_steps=max_steps, max_tokens_per_batch=max_tokens_per_batch,
                    tokens_per_step=tokens_per_step, lr=lr, warmup=warmup, warmup_from_zero=warmup_from_zero,
                    schedule=schedule, optimizer=optimizer, weight_decay=weight_decay, muon_lr=muon_lr,
                    muon_weight_decay=muon_weight_decay, adamw_betas=adamw_betas, mask_alignment=mask_alignment,
                    length_sorted=length_sorted, packed_steps=packed_steps, train_lm_head=train_lm_head,
                    init_std=init_std, device=device, heldout_fraction=heldout_fraction, init_from=init_from,
                    drafter_geometry=drafter_geometry)
    run.drafter.activation_checkpointing = activation_checkpointing
    this_run = run_key(arguments) if resume_dir else None
    progress = Progress()
    state = read_resume_checkpoint(resume_dir, this_run) if resume_dir else None
    if state is not None:
        restore_loop_state(state, run.drafter, run.optimizer, run.device)
        progress = Progress(**{field.name: state[field.name] for field in dataclasses.fields(Progress)})
        log.info("resuming from step %d/%d (%s)", progress.step, run.total_steps, resume_dir)
    if distributed:  # after the restore, as DDP starts by broadcasting rank 0's weights
        run.model = DistributedDataParallel(run.drafter, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    with open_trackers(tracking if run.rank == 0 else None, Path(log_path).parent, "train_drafter",
                       first_step=progress.step + 1) as trackers:
        train_steps(run, progress, this_run, trackers, ttt_steps=ttt_steps, step_weight_decay=step_weight_decay,
                    max_grad_norm=max_grad_norm, log_every=log_every, num_workers=num_workers,
                    loss_settings=dict(supervise=supervise, temperature=temperature, tv_weight=tv_weight,
                                       mask_alignment=mask_alignment),
                    pin_memory=pin_memory, bf16=bf16, resume_dir=resume_dir, checkpoint_every=checkpoint_every)
    if run.rank > 0:
        return
    export_trained(run.drafter, target_dir, out_dir, trained_config_path, ttt_steps=ttt_steps,
                   verifier_name_or_path=verifier_name_or_path, export_dtype=export_dtype)
    write_tsv(log_path, log_columns(ttt_steps), progress.rows)
    if resume_dir and Path(resume_dir).exists():
        shutil.rmtree(resume_dir)


def start_run(shard_paths, manifest, d2t_path, t2d_path, target_dir, distributed, *, seed, ttt_steps, epochs,
              max_steps, max_tokens_per_batch, tokens_per_step, lr, warmup, warmup_from_zero, schedule, optimizer,
              weight_decay, muon_lr, muon_weight_decay, adamw_betas, mask_alignment, length_sorted, packed_steps,
              train_lm_head, init_std, heldout_fraction, init_from, drafter_geometry,
              device):
    """The Run of train_drafter's arguments: the target head, the training samples and their
    step lists, the new drafter on its device (lm_head frozen unless train_lm_head), its
    optimizers with warmup and decay (eaglenest.train.optim)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch_device(device)
    d2t, t2d = load_vocab(d2t_path, t2d_path)
    head = TargetHead(target_dir, device)
    samples = ShardSamples(shard_paths, keep=lambda i: not is_heldout(i, heldout_fraction))
    if len(samples) == 0:
        raise ValueError("no training samples left after the held-out split")
    drafter = new_drafter(target_dir, manifest, d2t, t2d, head, seed=seed, init_from=init_from,
                          geometry=drafter_geometry, init_std=init_std)
    drafter.to(device).train()
    drafter.lm_head.weight.requires_grad_(train_lm_head)
    supervised, counts = supervision(samples, ttt_steps, mask_alignment)
    lengths = [end - start for _, start, end, _ in samples.index]
    plan = functools.partial(epoch_steps, lengths, supervised, max_tokens_per_batch, tokens_per_step, seed,
                             length_sorted=length_sorted, packed=packed_steps)
    total_steps = max_steps if max_steps is not None else sum(len(plan(epoch)) for epoch in range(epochs))
    optimizers = build_optimizers(drafter, optimizer=optimizer, lr=lr, weight_decay=weight_decay, muon_lr=muon_lr,
                                  muon_weight_decay=muon_weight_decay, warmup=warmup, total_steps=total_steps,
                                  schedule=schedule, adamw_betas=adamw_betas, warmup_from_zero=warmup_from_zero)
    log.info("%d samples, %d steps, device %s, %d processes", len(samples), total_steps, device, world_size)
    return Run(drafter, drafter, head, samples, optimizers, device, rank, world_size, total_steps, plan,
               supervised, counts)


def epoch_loader(run, steps, num_workers, pin_memory):
    """(real, collated micro-batch) for each of this rank's rounds of `steps`, in order (see
    batches.rank_rounds; a dummy, real False, is masked by the step). Own generator: the worker
    seeds the loader draws leave the global RNG (saved in checkpoints) alone."""
    rounds = [turn for step in steps for turn in rank_rounds(step, run.rank, run.world_size)]
    loader = torch.utils.data.DataLoader(
        run.samples,
        batch_sampler=[indices for _, indices in rounds],
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory and run.device.type == "cuda",
        generator=torch.Generator(),
    )
    return zip([real for real, _ in rounds], loader)


def train_steps(run, progress, this_run, trackers, *, ttt_steps, step_weight_decay, max_grad_norm, loss_settings, log_every,
                num_workers, pin_memory, bf16, resume_dir, checkpoint_every):
    """Optimizer steps from progress.step to run.total_steps, logging every `log_every` steps
    and checkpointing every `checkpoint_every` (rank 0, into resume_dir). Every step's
    window_columns, lr and tokens/s (supervised tokens over the training time so far) go to
    `trackers` (rank 0's; TensorBoard's event files in tensorboard/train_drafter beside the log).
    `loss_settings`: ttt_loss's keywords (supervise, temperature, tv_weight, mask_alignment)."""
    bf16 = run.device.type == "cuda" if bf16 is None else bf16
    elapsed_before, start, first_step = progress.elapsed, time.time(), progress.step
    epoch, done = 0, progress.step  # resumed: skip the done epochs, then the epoch's done steps
    ticker = ProgressLines("training", run.total_steps, "steps", logger=log, rate_of="supervised tokens",
                           done=progress.step)
    while progress.step < run.total_steps:
        steps = run.plan(epoch)
        if done >= len(steps):
            epoch, done = epoch + 1, done - len(steps)
            continue
        steps = steps[done:][: run.total_steps - progress.step]
        rounds = iter(epoch_loader(run, steps, num_workers, pin_memory))
        for step in steps:
            turns = list(itertools.islice(rounds, len(rank_rounds(step, run.rank, run.world_size))))
            measured = optimizer_step(run, step, turns, bf16, ttt_steps, step_weight_decay, max_grad_norm,
                                      loss_settings)
            progress.step += 1
            tokens = sum(run.supervised[i] for batch in step for i in batch)
            progress.tokens += tokens
            ticker.advance(work=tokens)
            progress.window.append(measured)
            progress.elapsed = elapsed_before + time.time() - start
            trackers.log({f"train/{name}": value for name, value in zip(window_columns(ttt_steps), measured)}
                         | {"train/lr": run.optimizer.last_lr(), "train/tokens_per_s": progress.tokens / progress.elapsed},
                         step=progress.step)
            if progress.step % log_every == 0 or progress.step == run.total_steps:
                log_row(run, progress, epoch, ttt_steps, rate=(progress.step - first_step) / (time.time() - start))
            if resume_dir and run.rank == 0 and progress.step % checkpoint_every == 0 and progress.step < run.total_steps:
                trackers.flush()
                save_loop_state(Path(resume_dir) / CHECKPOINT, run.drafter, run.optimizer, run.device,
                                run_key=this_run, **dataclasses.asdict(progress))
        epoch, done = epoch + 1, 0


def optimizer_step(run, step, turns, bf16, ttt_steps, step_weight_decay, max_grad_norm, loss_settings):
    """One optimizer step over this rank's `turns` of the step's micro-batches: their gradients
    accumulate (DDP all-reduces once, at the last), each loss normalised over the whole step
    (loss.soft_ce_loss). -> window_columns' values: the step's weighted loss, step losses,
    accuracies and agreements (all ranks'), the gradients' norm before clipping.

    The hidden states cross to the device in their stored dtype (bf16 or FP8 at scale; FP8 is
    dequantized there, to bf16 under autocast, to float32 without). Under bf16
    autocast they stay so: the drafter's fc and the target head cast them to bf16 and to the
    target's dtype, just as from float32 (the values are the same), and a float32 copy would
    double their device memory. Without autocast they go float32 there, the drafter's dtype."""
    normalisers = step_normalisers(step, run.counts)
    stats = torch.zeros(ttt_steps, 4, dtype=torch.float64, device=run.device)
    run.optimizer.zero_grad()
    for i, (real, batch) in enumerate(turns):
        batch = {key: t.to(run.device, non_blocking=True) for key, t in batch.items()}
        batch = dequantize_states(batch, torch.bfloat16 if bf16 else torch.float32)  # FP8 states: here, on the device
        if not bf16:
            batch.update({key: t.float() for key, t in batch.items() if t.is_floating_point()})
        if not real:
            batch["loss_mask"].zero_()
        sync = i == len(turns) - 1 or run.world_size == 1
        with contextlib.nullcontext() if sync else run.model.no_sync():
            with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, micro_stats = ttt_loss(run.model, batch, run.head, run.drafter.t2d, ttt_steps,
                                             step_weight_decay, normalisers, run.world_size, **loss_settings)
            loss.backward()
        stats += micro_stats
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in run.drafter.parameters() if p.requires_grad], max_grad_norm)
    run.optimizer.step()
    value, step_losses, step_accs, step_agreements = step_means(global_sum(stats, run.world_size), step_weight_decay)
    return [value, *step_losses, *step_accs, *step_agreements, float(grad_norm)]


def log_row(run, progress, epoch, ttt_steps, rate):
    """Close the window: one row of means for the training log, and a progress line (`rate`:
    steps per second in this process)."""
    means = [sum(column) / len(progress.window) for column in zip(*progress.window)]
    progress.window = []
    progress.rows.append([progress.step, epoch, run.optimizer.last_lr(), *means, progress.tokens,
                          progress.elapsed])
    accs, agreements = (" ".join(f"{a:.3f}" for a in means[1 + i * ttt_steps : 1 + (i + 1) * ttt_steps])
                        for i in (1, 2))
    log.info(
        "step %d/%d epoch %d loss %.4f acc %s agreement %s | %.2f steps/s %.0f tok/s ETA %.1f min",
        progress.step, run.total_steps, epoch, means[0], accs, agreements,
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
