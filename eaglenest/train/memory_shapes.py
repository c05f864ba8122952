"""The drafter's tensors as the training memory model (eaglenest.train.memory, docs/MEMORY.md)
counts them: its parameters and hidden matrices, and, per token of one TTT step, what autograd
keeps (layer_saved, step_saved, positional_saved, recompute_leftover) and what the attention's
locals hold. Where the two layers differ (gqa, mla) each function branches on DrafterConfig.layer.
"""

F32, BF16, INT64, BOOL = 4, 2, 8, 1


def attention_widths(c):
    """Per token, the widths of the attention's tensors: (q after RoPE, keys, the values' storage,
    the attention output). gqa: heads of head_dim. mla (MLAttention): q and k of nh × (nope + rope)
    (k's rope part expanded to every head by the cat), v a view of kv_b_proj's output
    nh × (nope + v), which the TTT value list keeps whole, the output nh × v."""
    if c.layer == "mla":
        heads, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        return heads * qk, heads * qk, heads * (c.qk_nope_head_dim + c.v_head_dim), heads * c.v_head_dim
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return q, kv, kv, q


def attention_projections(c):
    """The attention's Linear layers before it, as [rows, columns]: (those making q, those making
    the keys and values). gqa: q_proj; k_proj, v_proj. mla: q_proj, or q_a_proj and q_b_proj;
    kv_a_proj_with_mqa and kv_b_proj."""
    H = c.hidden_size
    if c.layer == "mla":
        heads, qk, kv_lora = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.kv_lora_rank
        query = ([[heads * qk, 2 * H]] if c.q_lora_rank is None
                 else [[c.q_lora_rank, 2 * H], [heads * qk, c.q_lora_rank]])
        return query, [[kv_lora + c.qk_rope_head_dim, 2 * H], [heads * (c.qk_nope_head_dim + c.v_head_dim), kv_lora]]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return [[q, 2 * H]], [[kv, 2 * H], [kv, 2 * H]]


def elements(shapes):
    """The elements of the matrices of these [rows, columns]."""
    return sum(rows * columns for rows, columns in shapes)


def hidden_matrices(c):
    """The sizes of the Linear layers but lm_head: fc, the attention's (attention_projections and
    o_proj), the MLP (Muon's share: optim.is_hidden_matrix), as [rows, columns]."""
    H, I = c.hidden_size, c.intermediate_size
    query, key_value = attention_projections(c)
    return [[H, 3 * c.target_hidden_size], *query, *key_value, [H, attention_widths(c)[3]], [I, H], [I, H], [H, I]]


def parameter_counts(c, train_lm_head=True):
    """(trainable parameters, those of the Linear layers, the largest trainable Linear) of
    DrafterConfig `c`: fc, the attention's, the MLP, lm_head (unless frozen), four RMSNorm weights,
    input_norm's (norm_before_fc) and mla's q_a_layernorm (with a q_lora_rank) and kv_a_layernorm
    (vectors: AdamW's share under Muon). The embedding is the target's (frozen)."""
    lm_head = c.hidden_size * c.draft_vocab_size
    trained = [rows * columns for rows, columns in hidden_matrices(c)] + ([lm_head] if train_lm_head else [])
    norms = 4 * c.hidden_size + (3 * c.target_hidden_size if c.norm_before_fc else 0)
    if c.layer == "mla":
        norms += (c.q_lora_rank or 0) + c.kv_lora_rank
    return sum(trained) + norms, sum(trained) + (0 if train_lm_head else lm_head), max(trained)


def layer_saved(c, autocast):
    """Bytes per token autograd keeps of one TTT step's decoder layer without activation
    checkpointing, as (before the attention, after it). The RMSNorms compute in float32: each keeps
    its float32 input, its normalised value (cast back to the input's dtype) and its [.., 1] scale.
    Under bf16 autocast the Linear layers keep a bf16 copy of their input each (gqa's q, k, v three,
    mla's q_a (or q) and kv_a two, gate and up two) and their outputs are bf16; without it the
    float32 tensors are shared. mla's inner norms return float32 (a float32 weight times the
    normalised value), kept by q_b_proj and kv_b_proj (autocast: as a bf16 copy); kv_a_layernorm's
    input is a view of kv_a_proj_with_mqa's output, so in float32 it keeps that whole storage (the
    rope part too; autocast: a float32 copy of the kv_lora_rank part). RoPE keeps only its cos and
    sin (positional_saved); the softmax factor, a Python float, nothing."""
    H, I = c.hidden_size, c.intermediate_size
    q, _, _, out = attention_widths(c)
    x = BF16 if autocast else F32  # the Linear layers' outputs, normalised values cast back
    projections = 2 if c.layer == "mla" else 3  # mla: q_a_proj (or q_proj), kv_a_proj_with_mqa
    before = {
        "input_layernorm normalised embeddings (float32: embeds are cast to the fc dtype)": F32 * H,
        "hidden_norm float32 input (autocast: a copy of the bf16 hidden)": F32 * H if autocast else 0,
        "hidden_norm normalised": x * H,
        "attention input cat[e, hidden_norm(h)] (autocast: a bf16 copy per projection reading it)":
            projections * BF16 * 2 * H if autocast else F32 * 2 * H,
        "q after RoPE (held by the attention checkpoint)": x * q,
        "norm scales [.., 1] (hidden_norm, post_attention_layernorm)": 2 * F32,
    }
    if c.layer == "mla":
        inner = {"q_a_layernorm": (c.q_lora_rank or 0, 0), "kv_a_layernorm": (c.kv_lora_rank, c.qk_rope_head_dim)}
        for norm, (rank, rope) in inner.items():
            if rank:
                before |= {f"{norm} float32 input": F32 * (rank + (0 if autocast else rope)),
                           f"{norm} normalised": x * rank, f"{norm} scale": F32, f"{norm} output, the b_proj's input": x * rank}
    after = {
        "attention output, o_proj's input": x * out,
        "residual r, post_attention_layernorm's float32 input": F32 * H,
        "post_attention_layernorm normalised": x * H,
        "gate/up input (autocast: a bf16 copy each)": 2 * BF16 * H if autocast else F32 * H,
        "MLP: gate, silu(gate), up, their product": 4 * x * I,
    }
    return before, after


def step_saved(c, autocast, checkpointing, cpu, train_lm_head=True):
    """Bytes per token one TTT step keeps until backward, besides its logits, in groups of named
    tensors. "layer": layer_saved, or with activation checkpointing only the checkpoint's inputs.
    "lm": the final norm (float32 input: in float32 the step output itself, which is also the next
    step's hidden input; normalised value; scale) and lm_head's input. "log_softmax": its output
    (float32, but bf16 under CPU autocast, which leaves log_softmax alone) and the bool mask the
    soft CE multiplies by, per supervised position (a frozen lm_head keeps no input: its weight
    needs no gradient). "kv": the keys after RoPE and the values,
    held by reference (the TTT key/value lists, which the attend closure given to a checkpoint
    keeps), so saved_tensors_hooks do not see them."""
    H, N = c.hidden_size, c.draft_vocab_size
    _, keys, values, _ = attention_widths(c)
    x = BF16 if autocast else F32
    if checkpointing:
        layer = {"embeddings cast to float32": F32 * H,
                 "hidden input in bf16 (float32: the previous step output, in lm)": BF16 * H if autocast else 0}
    else:
        before, after = layer_saved(c, autocast)
        layer = before | after
    return {
        "layer": layer,
        "lm": {"norm float32 input": F32 * H, "norm normalised": x * H, "norm scale": F32,
               "lm_head input": x * H if train_lm_head else 0},
        "log_softmax": {"log_softmax output": BF16 * N if autocast and cpu else F32 * N, "the step's mask": BOOL},
        "kv": {"keys and values after RoPE": x * (keys + values)},
    }


def positional_saved(c, checkpointing):
    """Bytes per position (per index of the padded length, shared by a micro-batch's samples) one
    step keeps: RoPE's float32 cos and sin [T, D] for q and for k (a checkpoint recomputes them;
    it keeps the int64 positions instead). mla: D is head_dim, its qk_rope_head_dim."""
    return INT64 if checkpointing else 4 * F32 * c.head_dim


def recompute_leftover(c, autocast):
    """Bytes per token a checkpointed step's recompute in backward leaves until backward ends: its
    new keys and values go into the TTT lists (which the checkpoint inputs hold), and with them the
    autograd graph that made them: the input of the projections making them (float32, or a bf16
    copy each: gqa's k/v_proj two, mla's kv_a_proj_with_mqa one), mla's kv_a_layernorm (as
    layer_saved) and kv_b_proj's input, input_layernorm's and hidden_norm's normalised values,
    hidden_norm's scale (and, under autocast, its float32 input copy). Per position it keeps k's
    cos and sin (positional_saved / 2)."""
    H = c.hidden_size
    _, keys, values, _ = attention_widths(c)
    x = BF16 if autocast else F32
    readers = 1 if c.layer == "mla" else 2
    leftover = {"keys and values after RoPE": x * (keys + values),
                "k/v input": readers * BF16 * 2 * H if autocast else F32 * 2 * H,
                "input_layernorm normalised": F32 * H, "hidden_norm normalised": x * H,
                "hidden_norm float32 input": F32 * H if autocast else 0, "hidden_norm scale": F32}
    if c.layer == "mla":
        leftover |= {key: value for key, value in layer_saved(c, autocast)[0].items() if key.startswith("kv_a_layernorm")}
    return leftover


def attention_locals(c, autocast, checkpointing):
    """Bytes per token MLAttention.forward's locals hold while it attends, besides q, the keys and
    values and what autograd keeps: q_nope's storage (q_b_proj's or q_proj's output: the cat made
    q anew), the rotated q_pe and k_pe, and compressed's storage (kv_a_proj_with_mqa's output,
    which in float32 without checkpointing kv_a_layernorm keeps already). gqa's: none (its q, k,
    v are the rotated ones)."""
    if c.layer != "mla":
        return 0
    heads, qk, rope = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_rope_head_dim
    compressed = c.kv_lora_rank + rope if autocast or checkpointing else 0
    return (BF16 if autocast else F32) * (heads * qk + heads * rope + rope + compressed)
