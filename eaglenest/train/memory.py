"""The peak memory of one drafter training process, from the geometry alone (docs/MEMORY.md).

`training_memory` follows one micro-batch as eaglenest.train.loop runs it (the cast of the batch
on the device, TargetHead.distribution, Drafter.forward over K TTT steps, the soft CE and total
variation of ttt_loss, backward, the optimizer's step: AdamW, or Muon and AdamW) and sums the
tensors alive at each moment where the peak can fall; the peak is the largest sum. Every term is
a tensor of the real code, in bytes from its shape and dtype (the drafter's, per token:
eaglenest.train.memory_shapes, for either layer). Those autograd keeps for backward were listed
from the code; tests/test_memory_model.py checks the list against
torch.autograd.graph.saved_tensors_hooks, and the peaks against measured ones
(bench/train_memory_model.py). Left out: tensors of a few bytes per token or fewer (masks,
the loss's per-position values, scalars) and what sits outside torch's tensors: the CUDA context,
the caching allocator's reserve and fragmentation, kernels' workspaces. A budget keeps a margin
for those.
"""

from eaglenest.drafter.model import ATTENTION_BLOCK
from eaglenest.train.memory_shapes import (BF16, BOOL, F32, INT64, attention_locals, attention_projections,
                                           attention_widths, elements, hidden_matrices, layer_saved,
                                           parameter_counts, positional_saved, recompute_leftover, step_saved)

# Held from one step to the next (and the gradients while a step accumulates), then through a step.
BETWEEN_STEPS = ("weights", "optimizer_states", "ddp_buckets", "frozen_embedding", "target_head", "vocab_maps")
HELD = (*BETWEEN_STEPS, "batch_stored", "batch_float32")


def static_memory(c, *, target_dtype_bytes, tied_embeddings=False, distributed=False, optimizer="adamw",
                  train_lm_head=True):
    """Bytes held between steps: the drafter's trainable weights, their gradients and the
    optimizer's states (float32 each: AdamW's two moments; Muon's one momentum for the hidden
    matrices, AdamW's two for the rest); with DDP (`distributed`) its gradient buckets, one more float32 copy
    of the gradients (the loop leaves gradient_as_bucket_view off); the vocab maps (d2t int64 [N],
    t2d bool [V]); in the target's dtype the frozen embedding the drafter shares with the target
    head, that head's lm_head (none of its own when the target ties it to the embedding) and its
    final norm weight."""
    params = parameter_counts(c, train_lm_head)[0]
    matrices = elements(hidden_matrices(c)) if optimizer == "muon" else 0
    V, H = c.target_vocab_size, c.hidden_size
    return {
        "weights": F32 * params,
        "gradients": F32 * params,
        "optimizer_states": F32 * matrices + 2 * F32 * (params - matrices),
        "ddp_buckets": F32 * params if distributed else 0,
        "vocab_maps": INT64 * c.draft_vocab_size + BOOL * V,
        "frozen_embedding": target_dtype_bytes * V * H,
        "target_head": target_dtype_bytes * ((0 if tied_embeddings else V * H) + H),
    }


def batch_memory(c, *, tokens, stored_dtype_bytes, cpu):
    """Bytes of the micro-batch the step reads: input_ids (int64) and loss_mask (bool), and the aux
    [tokens, 3Ht] and final [tokens, H] states, which the loop casts to float32 on the device. On a
    GPU the copies in the stored dtype are dropped once cast ("batch_stored": the ids and mask); on
    CPU the collated batch is the device's and stays beside its float32 casts (none if float32)."""
    states = tokens * (3 * c.target_hidden_size + c.hidden_size)
    stored = tokens * (INT64 + BOOL) + (stored_dtype_bytes * states if cpu else 0)
    return {"batch_stored": stored, "batch_float32": F32 * states if not cpu or stored_dtype_bytes != F32 else 0}


def head_peak(c, *, tokens, target_dtype_bytes, chunk_tokens):
    """The most TargetHead.distribution holds at once: the float32 probs of the chunks done, and
    for the chunk at hand its [n, V] logits in the target's dtype (made while the loop variable
    still holds the previous chunk's), then its float32 draft-vocab columns and their softmax; at
    the end the chunks and their torch.cat (2 × [tokens, N] float32) beside the last logits."""
    V, N, done, previous, peak = c.target_vocab_size, c.draft_vocab_size, 0, 0, 0
    for size in [min(chunk_tokens, tokens - start) for start in range(0, tokens, chunk_tokens)]:
        peak = max(peak, F32 * N * done + target_dtype_bytes * V * (previous + size),
                   F32 * N * done + size * (target_dtype_bytes * V + 2 * F32 * N))
        done, previous = done + size, size
    return max(peak, 2 * F32 * N * tokens + target_dtype_bytes * V * previous)


def retained_activations(c, *, tokens, longest, ttt_steps, autocast=False, checkpointing=False, cpu=False,
                         train_lm_head=True):
    """Bytes autograd keeps from the forward of all K steps to their backward, by group: "once"
    (fc's float32 output, or under autocast its bf16 input copy; with norm_before_fc also
    input_norm's normalised [tokens, 3Ht] float32, and in float32 fc's input, input_norm's output),
    then per step (K ×) the groups of step_saved, log_softmax's at the positions step k supervises
    only (longest - k - 2 a sample), "positions" (positional_saved × longest) and "norm_output":
    under autocast a normed (float32) hidden input turns the residual stream of steps 1..K-1
    float32, three [tokens, H] tensors a step where they were bf16 (checkpointed: the float32
    input the checkpoint keeps); in float32 with a frozen lm_head, whose input is then not kept,
    the next step still keeps that normed output. Under autocast the bf16 weight copies come on top (autocast_weights)."""
    Ht3, H = 3 * c.target_hidden_size, c.hidden_size
    once = tokens * ((BF16 * Ht3) if autocast else F32 * H)
    if c.norm_before_fc:
        once += tokens * Ht3 * (F32 if autocast else 2 * F32)
    saved = step_saved(c, autocast, checkpointing, cpu, train_lm_head)
    groups = {key: ttt_steps * tokens * sum(part.values()) for key, part in saved.items()}
    supervised = (tokens // longest) * sum(max(longest - k - 2, 0) for k in range(ttt_steps))
    groups["log_softmax"] = supervised * sum(saved["log_softmax"].values())
    if not c.norm_output:
        normed = 0
    elif autocast:
        normed = F32 * H if checkpointing else 3 * (F32 - BF16) * H
    else:
        normed = 0 if train_lm_head else F32 * H
    return {"once": once, **groups, "positions": ttt_steps * longest * positional_saved(c, checkpointing),
            "norm_output": (ttt_steps - 1) * tokens * normed}


def autocast_weights(c, ttt_steps=3, train_lm_head=True):
    """bf16 copies of the Linear weights autocast makes, as (all: made in the forward; kept by
    autograd to backward: all but fc, whose input needs no gradient unless input_norm made it;
    kept when the layer is checkpointed: lm_head's, and fc's with input_norm; the layer's: remade
    by its recompute).
    Autocast caches the copy of a weight that requires grad for the whole forward; a frozen
    lm_head's is made anew, and kept, at each of the K steps."""
    H, Ht = c.hidden_size, c.target_hidden_size
    _, linears, _ = parameter_counts(c)
    fc, lm_head = 3 * Ht * H, H * c.draft_vocab_size
    lm_heads = lm_head if train_lm_head else ttt_steps * lm_head
    kept = linears - lm_head + lm_heads - (0 if c.norm_before_fc else fc)
    checkpointed = lm_heads + (fc if c.norm_before_fc else 0)
    return BF16 * (linears - lm_head + lm_heads), BF16 * kept, BF16 * checkpointed, BF16 * (linears - fc - lm_head)


def attention_scores(c, *, tokens, longest, ttt_steps, attention_block=ATTENTION_BLOCK):
    """Score elements of the largest block of ttt_attention (the last query block of the last TTT
    step): samples × heads × block queries × (longest + K - 1) keys."""
    return (tokens // longest) * c.num_attention_heads * min(attention_block, longest) * (longest + ttt_steps - 1)


# Bytes per score element alive in one ttt_attention block at its peak. Forward: the masked scores,
# their cat with the diagonal and the float32 softmax (float32: 3 × 4; autocast: the masked
# scores and the cat in bf16, the float32 cast of the cat and its softmax, 2 × 2 + 2 × 4).
# Backward (the block recomputed, then its backward): the saved softmax, and the probabilities'
# gradient being summed: the full-size gradients of the value product's slice and of the
# diagonal's select, and their sum (float32: 4 + 3 × 4; autocast: the float32 softmax and the bf16
# probabilities the value product keeps, 4 + 2, and the three gradients in bf16, 3 × 2).
ATTENTION_BYTES = {"forward": {False: 12, True: 12}, "backward": {False: 16, True: 12}}


def step_totals(c, activations, *, tokens, longest, ttt_steps, autocast):
    """Bytes of one TTT step for the micro-batch, by part: the groups of retained_activations (one
    step's share), "before"/"after" (layer_saved), "cos_sin" (positional_saved without checkpointing),
    "leftover" (recompute_leftover, with k's cos and sin and, under autocast, the bf16 weights of
    the projections making the keys and values), "out" (float32: the step output, which a
    checkpoint of the next step holds)."""
    H = c.hidden_size
    parts = {key: value // ttt_steps for key, value in activations.items() if key != "once"}
    before, after = (tokens * sum(part.values()) for part in layer_saved(c, autocast))
    cos_sin = longest * positional_saved(c, False)
    leftover = (tokens * sum(recompute_leftover(c, autocast).values()) + cos_sin // 2
                + (BF16 * elements(attention_projections(c)[1]) if autocast else 0))
    return parts | {"once": activations["once"], "before": before, "after": after, "cos_sin": cos_sin,
                    "leftover": leftover, "out": 0 if autocast else F32 * tokens * H}


def forward_moments(c, terms, s, block, *, tokens, ttt_steps, autocast, checkpointing, cpu, held, train_lm_head):
    """at_head, at_forward_attention (the last step's attention block: the earlier steps' tensors and
    logits, this step's up to its attention with the locals the layer holds then, i.e. the float32
    embeddings, e and hidden_norm(h), the blocks' outputs and mla's attention_locals), at_forward_end (the last step's soft
    CE: every step's tensors and logits, the float32 product target × log_softmax, on CPU under
    autocast also the float32 copy of the bf16 log_softmax it makes for it)."""
    K, H = ttt_steps, c.hidden_size
    q, _, _, out = attention_widths(c)
    x = BF16 if autocast else F32
    every = autocast_weights(c, ttt_steps, train_lm_head)[0] if autocast else 0
    one_step = sum(s[key] for key in ("layer", "lm", "log_softmax", "kv", "positions"))
    up_to_attention = s["kv"] + s["positions"] + tokens * (3 * F32 * H + x * out + attention_locals(
        c, autocast, checkpointing)) + (
        s["layer"] + tokens * x * q if checkpointing else s["before"])
    float_scores = F32 * tokens * c.draft_vocab_size
    return {
        "at_head": held + terms["head_peak"],
        "at_forward_attention": held + terms["target_probs"] + every + s["once"] + (K - 1) * (
            one_step - s["log_softmax"] + tokens * c.draft_vocab_size * x) + up_to_attention + block["forward"],
        "at_forward_end": held + terms["target_probs"] + every + terms["activations"] + terms["logits"]
        + float_scores * (2 if autocast and cpu else 1),
    }


def backward_moments(c, terms, s, block, *, tokens, longest, ttt_steps, autocast, checkpointing, accumulating, cpu,
                     held, train_lm_head, optimizer, tv_weight=0.0):
    """at_backward_start: the first log_softmax backward (the logits are freed): every step's
    tensors, the probs, the float32 gradient of the soft CE w.r.t. log_softmax and log_softmax's
    of its input. Autograd runs every step's loss backward first, so the steps' logits gradients
    wait for their lm_head meanwhile.
    at_backward_attention: the backward of step j's largest attention block (the last step without
    checkpointing): the steps before j whole, with their logits' gradients; step j up to its
    attention; the gradients of its attention output and hidden input, and of the weights so far
    (all but fc and, at the last step, q/k/v); the block's backward scores. With checkpointing
    step j's layer is recomputed beside its inputs (its keys and values twice: the forward's are
    still held), the steps after j hold their inputs, their recompute_leftover and (float32) their
    output, and j is the one of largest total.
    at_backward_tv (tv_weight > 0): the last step's TotalVariation.backward, the first node of its
    loss backward (autograd runs the later-made branch first: the soft CE's gradient is not made
    yet): every step's tensors, the probs, and its float32 q = exp(log_q) and q - p [positions, N]
    (a float32 copy of the bf16 log_softmax and q under CPU autocast, as many bytes). Its gradient
    then waits in log_softmax's input buffer while the soft CE's is made, and autograd adds that
    into it in place: in float32, two [positions, N] again; under CPU autocast its bf16 gradient,
    the CE's float32 one and that one's bf16 cast, two float32 [positions, N] in all. So on a GPU
    (float32 log_softmax) it is never above at_backward_start; on CPU under autocast it is by a
    bf16 [positions, N]; either way below at_forward_end, which holds every step's logits.
    at_backward_layer (checkpointing): step j's layer just recomputed, before and after its attention.
    at_optimizer: the optimizer step with every gradient (optimizer_transient)."""
    K, N, H = ttt_steps, c.draft_vocab_size, c.hidden_size
    out = attention_widths(c)[3]
    x = BF16 if autocast else F32
    params = parameter_counts(c, train_lm_head)[0]
    fc, qkv = 3 * c.target_hidden_size * H, elements(sum(attention_projections(c), []))
    _, kept, lm_head, layer = autocast_weights(c, ttt_steps, train_lm_head) if autocast else (0, 0, 0, 0)
    kept, layer = (lm_head, layer) if checkpointing else (kept, 0)
    gradients = 0 if accumulating else terms["gradients"]
    moments = {"at_backward_start": held + terms["target_probs"] + kept + terms["activations"]
               + F32 * tokens * N + s["log_softmax"]}
    if tv_weight:
        positions = (tokens // longest) * max(longest - K - 1, 0)  # the last step's supervised positions
        moments["at_backward_tv"] = (held + terms["target_probs"] + kept + terms["activations"]
                                     + 2 * F32 * positions * N)  # q and q - p
    whole = s["layer"] + s["lm"] + s["kv"] + s["positions"] + tokens * N * x  # a step before j, its logits' gradient
    attention, layer_done = [], []
    for j in range(K) if checkpointing else [K - 1]:
        made = 0 if accumulating else F32 * (params - fc - (qkv if j == K - 1 else 0))
        base = held + kept + s["once"] + j * whole + s["kv"] + s["positions"] + s["before"]
        if checkpointing:
            later = K - 1 - j
            base += (s["layer"] + s["kv"] + s["cos_sin"] + layer + later * s["out"]
                     + later * (s["layer"] + s["kv"] + s["positions"] + s["leftover"]))
            lm_made = 0 if accumulating else F32 * (H * N * train_lm_head + H) if j == K - 1 else made
            layer_done.append(base + lm_made + s["after"] + tokens * H * x)
        attention.append(base + made + tokens * (out + H) * x + block["backward"])
    moments["at_backward_attention"] = max(attention)
    if checkpointing:
        moments["at_backward_layer"] = max(layer_done)
    moments["at_optimizer"] = held + gradients + optimizer_transient(c, optimizer, cpu, train_lm_head)
    return moments


def optimizer_transient(c, optimizer, cpu, train_lm_head=True):
    """The most an optimizer step allocates beside the held state. AdamW: one float32 sqrt of the
    second moments, of every parameter at once with CUDA's foreach kernels, of the largest tensor
    twice per tensor on CPU. Muon (torch.optim.Muon, one matrix at a time) for its largest matrix
    [m, n] (m' = min(m, n)): the Nesterov update (float32 [m, n]), its bf16 copy and the next
    Newton-Schulz iterate (2 × bf16 [m, n]), the Gram matrix, its update and the previous update
    (3 × bf16 [m', m']); AdamW's share for the rest after it."""
    params, _, largest = parameter_counts(c, train_lm_head)
    if optimizer == "adamw":
        return F32 * (2 * largest if cpu else params)
    matrices = hidden_matrices(c)
    rest = params - elements(matrices)
    rest_largest = c.hidden_size * c.draft_vocab_size if train_lm_head else 3 * c.target_hidden_size
    rows, columns = max(matrices, key=lambda shape: shape[0] * shape[1])
    muon = (F32 + 2 * BF16) * rows * columns + 3 * BF16 * min(rows, columns) ** 2
    return max(muon, F32 * (2 * rest_largest if cpu else rest))


def training_memory(c, *, target_dtype_bytes, tokens, longest, ttt_steps, activation_checkpointing=False,
                    autocast_bf16=False, chunk_tokens=4096, attention_block=None, stored_dtype_bytes=BF16,
                    accumulating=True, tied_embeddings=False, distributed=False, device="cuda", optimizer="adamw",
                    train_lm_head=True, tv_weight=0.0):
    """Bytes of one training process for DrafterConfig `c` (the geometry make_drafter_config gives)
    and a micro-batch of `tokens` padded tokens whose longest sample has `longest` (samples =
    tokens // longest), trained with `ttt_steps` TTT steps: a dict of the terms of static_memory
    and batch_memory, "target_probs" (float32 [tokens, N]), "head_peak", "activations"
    (retained_activations, all groups), "autocast_weights" (all bf16 copies), "logits" (K ×
    [tokens, N] in the compute dtype), "attention_block" (ATTENTION_BYTES × the largest block's
    scores, forward or backward), the totals at the moments where the peak can fall ("at_*":
    forward_moments and backward_moments, each the terms HELD through the step, the gradients
    when accumulating, and what that moment holds), and "peak", the largest total.

    target_dtype_bytes: the target's stored dtype (2: bf16), that of the frozen embedding and the
    target head. stored_dtype_bytes: the shards' states (2: bf16). chunk_tokens: TargetHead's.
    attention_block: ttt_attention's block of queries (None: ATTENTION_BLOCK). accumulating: the
    step has more micro-batches, so the earlier ones' gradients are held through this one (the
    loop's steady state); False: they appear during backward. distributed: DDP (static_memory's
    buckets). device "cpu": no separate device memory (batch_memory), CPU autocast's op lists
    (log_softmax stays bf16) and AdamW's per-tensor update (foreach on CUDA). optimizer: adamw or
    muon (train.optimizer); train_lm_head False: lm_head frozen (no gradient, no state, no input kept).
    tv_weight (train.tv_weight) > 0: the total variation term's backward (at_backward_tv). Its
    forward runs at any weight (the log's agreement) and its float32 exp(log_q) [positions, N]
    follows the soft CE's product of that size, once that is freed: at_forward_end holds either."""
    cpu, x = device == "cpu", BF16 if autocast_bf16 else F32
    terms = static_memory(c, target_dtype_bytes=target_dtype_bytes, tied_embeddings=tied_embeddings,
                          distributed=distributed, optimizer=optimizer, train_lm_head=train_lm_head)
    terms |= batch_memory(c, tokens=tokens, stored_dtype_bytes=stored_dtype_bytes, cpu=cpu)
    terms["target_probs"] = F32 * tokens * c.draft_vocab_size
    terms["head_peak"] = head_peak(c, tokens=tokens, target_dtype_bytes=target_dtype_bytes, chunk_tokens=chunk_tokens)
    activations = retained_activations(c, tokens=tokens, longest=longest, ttt_steps=ttt_steps, autocast=autocast_bf16,
                                       checkpointing=activation_checkpointing, cpu=cpu, train_lm_head=train_lm_head)
    terms["activations"] = sum(activations.values())
    terms["autocast_weights"] = autocast_weights(c, ttt_steps, train_lm_head)[0] if autocast_bf16 else 0
    terms["logits"] = ttt_steps * x * tokens * c.draft_vocab_size
    scores = attention_scores(c, tokens=tokens, longest=longest, ttt_steps=ttt_steps,
                              attention_block=attention_block or ATTENTION_BLOCK)
    block = {phase: scores * per_element[autocast_bf16] for phase, per_element in ATTENTION_BYTES.items()}
    terms["attention_block"] = max(block.values())
    held = sum(terms[key] for key in HELD) + (terms["gradients"] if accumulating else 0)
    s = step_totals(c, activations, tokens=tokens, longest=longest, ttt_steps=ttt_steps, autocast=autocast_bf16)
    options = dict(tokens=tokens, ttt_steps=ttt_steps, autocast=autocast_bf16, checkpointing=activation_checkpointing,
                   cpu=cpu, held=held, train_lm_head=train_lm_head)
    terms |= forward_moments(c, terms, s, block, **options)
    terms |= backward_moments(c, terms, s, block, longest=longest, accumulating=accumulating, optimizer=optimizer,
                              tv_weight=tv_weight, **options)
    terms["peak"] = max(value for key, value in terms.items() if key.startswith("at_"))
    return terms
