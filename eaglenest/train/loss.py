"""The training-time-test loss (docs/TRAINING.md, "The drafter").

Per position p the target's distribution over the next token is
softmax(lm_head(norm(final_hidden_state[p])) / temperature) restricted to the draft vocab (t2d)
and renormalised, at the temperature the drafter is fitted at (train.temperature). TTT step k at
anchor t predicts x_{t+k+2}, so it learns from the distribution at p = t+k+1 by soft cross-entropy
against the drafter's log_softmax(logits / temperature), plus tv_weight × their total variation
distance, weighted step_weight_decay**k, on positions where x_{t+k+2} was generated (loss_mask) and
exists, and, with supervise "in_draft_vocab", where the target's argmax is inside the draft vocab.
mask_alignment "input" (speculators') supervises where the step's input x_{t+k+1} was generated
instead: one position earlier at both ends of a response (MASK_OFFSET).
(Soft CE is KL(p || q) plus p's entropy, which the drafter does not change: the same gradient as a
KL loss. The distance is 1 - sum_x min(p, q), what probabilistic drafting accepts, rewarded
directly.)
"""

import torch
import torch.distributed as dist

# train.mask_alignment -> which token's loss_mask decides whether step k at anchor t is supervised:
# x_{t+k+1+offset}. "predicted" (x_{t+k+2}) supervises the first response token's prediction from
# the prompt's last token, which vLLM never drafts (it drafts after the target's first sample);
# "input" (x_{t+k+1}, speculators 0.9.0's shift_batch) supervises the prediction after the final
# end-of-turn token, which vLLM never drafts either (the request ends there).
MASK_OFFSET = {"predicted": 1, "input": 0}


def global_sum(tensor, world_size):
    """`tensor` summed in place over the DDP ranks (unchanged with one process)."""
    if world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def ttt_loss(model, batch, head, t2d, num_steps, step_weight_decay, normalisers, world_size=1, *,
             supervise="in_draft_vocab", temperature=1.0, tv_weight=0.0, mask_alignment="predicted"):
    """The weighted TTT loss of one micro-batch -> (loss to backpropagate, stats for the log:
    see soft_ce_loss). `normalisers`, `temperature`, `tv_weight`, `mask_alignment`: see
    soft_ce_loss. supervise
    "all": every generated position, the target's argmax in the draft vocab or not. Scaled by
    world_size: DDP averages the ranks' gradients, so the average is then their sum, one
    process's gradient of the step."""
    probs, in_vocab = head.distribution(batch["final_hidden_states"], t2d, temperature)  # [B, T, N]
    if supervise == "all":
        in_vocab = torch.ones_like(in_vocab)
    logits = model(batch["input_ids"], batch["aux_hidden_states"], num_steps)
    loss, stats = soft_ce_loss(logits, probs, in_vocab, batch["loss_mask"], normalisers, step_weight_decay,
                               temperature=temperature, tv_weight=tv_weight, mask_alignment=mask_alignment)
    return loss * world_size, stats


class TotalVariation(torch.autograd.Function):
    """0.5 * sum_x |p(x) - q(x)| over the last dim, q = exp(log_q), differentiable in log_q. Its
    backward keeps only p and log_q, which the soft CE keeps anyway: autograd's own would also keep
    q and p - q, two more float32 [positions, N] per TTT step (eaglenest.train.memory). Its two
    transients, q and q - p, are as many as the soft CE's gradient and log_softmax's hold right
    after it (at_backward_tv): computing q * sign(q - p) in one buffer would not lower the peak."""

    @staticmethod
    def forward(ctx, p, log_q):
        ctx.save_for_backward(p, log_q)
        return 0.5 * log_q.to(p.dtype).exp().sub_(p).abs_().sum(-1)  # in p's dtype (float32): bf16 log_q too

    @staticmethod
    def backward(ctx, grad):
        p, log_q = ctx.saved_tensors
        q = log_q.to(p.dtype).exp()
        return None, q.mul_((q - p).sign_()).mul_(0.5 * grad[..., None]).to(log_q.dtype)


def soft_ce_loss(logits, probs, in_vocab, loss_mask, normalisers, step_weight_decay, *, temperature=1.0,
                 tv_weight=0.0, mask_alignment="predicted"):
    """sum_k step_weight_decay**k * (step k's loss sum over its positions) / normalisers[k], a
    position's loss its soft CE plus tv_weight × TV(p, q), p = `probs` (the target's, at
    `temperature`), q = softmax(logits / temperature) -> (that loss, stats [K, 4] float64: per
    step the loss sum, the count of positions, of correct argmaxes and the sum of sum_x min(p, q),
    over the supervised in-vocab positions). Step k at anchor t is supervised where
    x_{t+k+1+MASK_OFFSET[mask_alignment]} was generated.

    normalisers[k] counts the positions step k supervises (by the same alignment) over the whole
    optimizer step: all its micro-batches, on all ranks. It comes from the data's loss_mask
    alone, so it is known before the first micro-batch's backward and the micro-batches'
    gradients sum to the step's; positions whose target argmax is outside the draft vocab count
    in it but add no loss (that is known only once the target head ran). The log's means divide
    by the in-vocab counts instead (step_means)."""
    T, offset = loss_mask.shape[1], MASK_OFFSET[mask_alignment]
    loss, stats = 0.0, []
    for k, step_logits in enumerate(logits):
        n = max(T - k - 1 - offset, 0)  # anchors t whose masking token x_{t+k+1+offset} is in the batch
        target = probs[:, k + 1 : k + 1 + n]  # target's distribution of x_{t+k+2}
        mask = loss_mask[:, k + 1 + offset :] & in_vocab[:, k + 1 : k + 1 + n]
        step_logits = step_logits[:, :n]
        log_q = (step_logits / temperature).log_softmax(-1)
        ce = -(target * log_q).sum(-1)  # [B, n]
        tv = TotalVariation.apply(target, log_q if tv_weight else log_q.detach())  # weight 0: only logged
        correct = (step_logits.argmax(-1) == target.argmax(-1)) & mask
        count, tv_sum = mask.sum(), (tv * mask).sum()
        step_sum = (ce * mask).sum() + tv_weight * tv_sum
        loss = loss + step_weight_decay**k * (step_sum / normalisers[k])
        stats.append(torch.stack([step_sum.detach(), count, correct.sum(), count - tv_sum.detach()]).double())
    return loss, torch.stack(stats)


def step_means(stats, step_weight_decay):
    """Summed stats of an optimizer step -> (the weighted loss, per-step mean losses, per-step
    accuracies vs the target's argmax, per-step agreements sum_x min(p, q)), means over the
    supervised in-vocab positions."""
    loss_total, counts, corrects, agreements = stats.T.tolist()
    counts = [max(count, 1) for count in counts]
    step_losses = [c / count for c, count in zip(loss_total, counts)]
    value = sum(step_weight_decay**k * step_loss for k, step_loss in enumerate(step_losses))
    return (value, step_losses, [c / count for c, count in zip(corrects, counts)],
            [a / count for a, count in zip(agreements, counts)])
