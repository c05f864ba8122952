"""Training batches by token budget, as pure functions of the samples' lengths, the budgets, the
seed and the epoch: what every DDP rank, a resumed run and an uninterrupted one compute alike.

A micro-batch (one forward) holds samples whose padded size, count × longest, stays within
max_tokens; a longer sample is a micro-batch of its own. Within an epoch the samples are
shuffled, sorted by length within windows of WINDOW samples (so a micro-batch holds similar
lengths and little padding), cut by the budget, and the micro-batches shuffled again (so a step
mixes lengths). An optimizer step takes consecutive micro-batches until they hold
tokens_per_step supervised tokens (loss_mask positions: what the loss averages over).
packed_steps instead cuts the shuffled order into steps of at most tokens_per_step tokens,
prompts included, as speculators packs a batch (docs/RECIPE.md). The cut
by budget (states.shards.length_batches) is shared with the offline evaluation, which imports
nothing of train.
"""

import torch

from eaglenest.states.shards import budget_batches, length_batches

# Samples sorted by length together: large enough that neighbours differ little in length, small
# enough that a sample's micro-batch partners change from epoch to epoch.
WINDOW = 1024


def epoch_generator(seed, epoch):
    """The generator an epoch's shuffles draw from: a pure function of (seed, epoch)."""
    return torch.Generator().manual_seed(seed + 1_000_003 * epoch)


def epoch_micro_batches(lengths, max_tokens, seed, epoch, window=WINDOW, length_sorted=True):
    """The epoch's micro-batches of sample indices, every sample once, length-bucketed and
    shuffled as a pure function of (seed, epoch). length_sorted False: the shuffled order cut
    by the budget as it comes (speculators' random sampler before its packing), so a
    micro-batch, and a step, mixes lengths at the cost of more padding."""
    generator = epoch_generator(seed, epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if length_sorted:
        batches = length_batches(order, lengths, max_tokens, window)
    else:
        batches = budget_batches(order, lengths, max_tokens)
    return [batches[j] for j in torch.randperm(len(batches), generator=generator).tolist()]


def optimizer_steps(batches, supervised, tokens_per_step):
    """Consecutive `batches` grouped into optimizer steps of at least tokens_per_step
    supervised tokens (supervised[i]: sample i's); the epoch's last step may hold fewer."""
    steps, step, held = [], [], 0
    for batch in batches:
        step.append(batch)
        held += sum(supervised[i] for i in batch)
        if held >= tokens_per_step:
            steps.append(step)
            step, held = [], 0
    return steps + [step] if step else steps


def packed_steps(lengths, max_tokens, tokens_per_step, seed, epoch):
    """The epoch's shuffled order cut into runs of consecutive samples whose lengths sum to at
    most tokens_per_step (a longer sample alone), one run an optimizer step, each cut into
    micro-batches by max_tokens: speculators' packed batch, one a step. Padding instead of
    packing changes no gradient (a padded position has no loss, the step normalises)."""
    order = torch.randperm(len(lengths), generator=epoch_generator(seed, epoch)).tolist()
    runs, run, held = [], [], 0
    for i in order:
        if run and held + lengths[i] > tokens_per_step:
            runs.append(run)
            run, held = [], 0
        run.append(i)
        held += lengths[i]
    runs = runs + [run] if run else runs
    return [budget_batches(run, lengths, max_tokens) for run in runs]


def epoch_steps(lengths, supervised, max_tokens_per_batch, tokens_per_step, seed, epoch, length_sorted=True,
                packed=False):
    """The epoch's optimizer steps, each a list of micro-batches of sample indices. packed:
    packed_steps (tokens_per_step counts every token; length_sorted has no effect)."""
    if packed:
        return packed_steps(lengths, max_tokens_per_batch, tokens_per_step, seed, epoch)
    return optimizer_steps(epoch_micro_batches(lengths, max_tokens_per_batch, seed, epoch,
                                               length_sorted=length_sorted), supervised,
                           tokens_per_step)


def rank_rounds(step, rank, world_size):
    """This rank's turns of a step's micro-batches, (real, indices) per round: micro-batch
    round × world_size + rank, or where the step has none left a one-sample dummy (real False:
    masked, it adds nothing but joins DDP's gradient all-reduce). Every rank has as many rounds."""
    rounds = -(-len(step) // world_size)
    turns = [round_ * world_size + rank for round_ in range(rounds)]
    return [(True, step[j]) if j < len(step) else (False, step[-1][:1]) for j in turns]


def step_normalisers(step, counts):
    """Per TTT step k, the positions it supervises over all of the step's micro-batches:
    the sum of counts[i][k] over its samples (at least 1)."""
    samples = [i for batch in step for i in batch]
    return [max(sum(counts[i][k] for i in samples), 1) for k in range(len(counts[samples[0]]))]
