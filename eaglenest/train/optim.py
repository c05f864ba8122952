"""The optimizer and learning-rate schedule of a training run (docs/RECIPE.md).

`adamw`: AdamW over every trainable parameter. `muon`: torch.optim.Muon (torch >= 2.9) for the
drafter's hidden matrices (fc, q/k/v/o, the MLP), whose update it orthogonalises by five
Newton-Schulz iterations and scales to AdamW's update RMS (`match_rms_adamw`, so one learning
rate means about the same step size for both), and AdamW for the rest (the norms and lm_head:
an output head and vectors are no hidden linear maps). Both kinds are stepped as one
`Optimizers`, each with its own LambdaLR of the same schedule.
"""

import math

import torch

MUON_MOMENTUM = 0.95


def lr_factor(step, warmup, total_steps, schedule="cosine", warmup_from_zero=False):
    """Linear warmup over `warmup` steps, from lr / warmup at step 0 (warmup_from_zero: from 0,
    as transformers' schedules), then decay to 0 at `total_steps`: a half cosine (`cosine`) or
    a straight line (`linear`)."""
    if step < warmup:
        return (step if warmup_from_zero else step + 1) / warmup
    progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
    return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress


def is_hidden_matrix(name, param):
    """Muon's share: a 2-D weight of both sides > 1, but the output head."""
    return param.ndim == 2 and min(param.shape) > 1 and not name.startswith("lm_head")


class Optimizers:
    """Optimizers stepped as one, with their schedulers; state_dict and load_state_dict cover
    all of them, in order (what a resume checkpoint keeps)."""

    def __init__(self, optimizers, lr_lambda):
        self.optimizers = optimizers
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in optimizers]

    @property
    def param_groups(self):
        return [group for o in self.optimizers for group in o.param_groups]

    def zero_grad(self):
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def step(self):
        """An optimizer step, then a schedule step."""
        for o, scheduler in zip(self.optimizers, self.schedulers):
            o.step()
            scheduler.step()

    def last_lr(self):
        """AdamW's learning rate now (the log's `lr`; Muon's is `muon_lr` times the same factor)."""
        return self.schedulers[-1].get_last_lr()[0]

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state):
        for o, saved in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(saved)
        for s, saved in zip(self.schedulers, state["schedulers"], strict=True):
            s.load_state_dict(saved)


def build_optimizers(drafter, *, optimizer, lr, weight_decay, muon_lr, muon_weight_decay, warmup, total_steps,
                     schedule, adamw_betas=(0.9, 0.95), warmup_from_zero=False):
    """The run's Optimizers over the drafter's trainable parameters. muon_lr None: lr (as in
    speculators 0.9.0)."""
    named = [(name, p) for name, p in drafter.named_parameters() if p.requires_grad]
    adamw = dict(betas=tuple(adamw_betas), weight_decay=weight_decay)
    if optimizer == "adamw":
        optimizers = [torch.optim.AdamW([p for _, p in named], lr=lr, **adamw)]
    elif optimizer == "muon":
        matrices = [p for name, p in named if is_hidden_matrix(name, p)]
        rest = [p for name, p in named if not is_hidden_matrix(name, p)]
        optimizers = [torch.optim.Muon(matrices, lr=lr if muon_lr is None else muon_lr,
                                       weight_decay=muon_weight_decay, momentum=MUON_MOMENTUM,
                                       adjust_lr_fn="match_rms_adamw")]
        optimizers += [torch.optim.AdamW(rest, lr=lr, **adamw)] if rest else []
    else:
        raise ValueError(f"train.optimizer {optimizer!r}: adamw or muon")
    return Optimizers(optimizers, lambda step: lr_factor(step, warmup, total_steps, schedule, warmup_from_zero))
