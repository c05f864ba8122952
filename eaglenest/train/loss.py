"""The training-time-test loss (docs/CONVENTIONS.md, "Drafter").

Per position p the target's distribution over the next token is
softmax(lm_head(norm(final_hidden_state[p]))) restricted to the draft vocab (t2d) and
renormalised. TTT step k at anchor t predicts x_{t+k+2}, so it learns from the distribution
at p = t+k+1 by soft cross-entropy, weighted step_weight_decay**k, on positions where
x_{t+k+2} was generated (loss_mask), exists, and is the target's argmax inside the draft vocab.
"""

import torch
import torch.distributed as dist


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
