"""Which hidden states the shards keep, in which convention (docs/HIDDEN_STATES.md, "Which states").

  aux states   the residual stream ENTERING each aux layer k (vLLM's convention, = HF
               hidden_states[k]), concatenated [T, 3H];
  final state  the residual stream leaving the last layer, BEFORE the final norm [T, H]
               (target logits = lm_head(norm(final))).
Both backends (HF and vLLM) store exactly these.
"""

import torch

from eaglenest.workflow.errors import InputError

FINAL_STATE_CONVENTION = "pre_norm"
# hidden_states.dtype: what the shards store. float8_e4m3fn is a storage format only (quantized per
# token, eaglenest.states.shards): the HF backend computes such states in COMPUTE_DTYPE.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn}
COMPUTE_DTYPE = {"float8_e4m3fn": "bfloat16"}


def compute_dtype(dtype):
    """The dtype the HF backend runs the target in for states stored in `dtype`."""
    return COMPUTE_DTYPE.get(dtype, dtype)


def default_aux_layer_ids(num_layers):
    """vLLM's default aux layers for EAGLE-3: (2, N // 2, N - 3)."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(aux_layer_ids, num_layers, count=3):
    """The configured ids, or vLLM's default when None; checked: `count` distinct ids in [0, num_layers).
    count None: an explicit list of layers to capture, any number (the agreement check's
    candidates, eaglenest.evaluate.agreement_states), stored concatenated in its order."""
    ids = default_aux_layer_ids(num_layers) if aux_layer_ids is None else list(aux_layer_ids)
    wanted = len(ids) if count is None else count
    if not ids or len(ids) != wanted or len(set(ids)) != wanted or not all(0 <= k < num_layers for k in ids):
        what = f"config hidden_states.aux_layer_ids: must be {count}" if count else "layers to capture: must be"
        raise InputError(f"{what} distinct layer ids in [0, {num_layers}), got {ids}")
    return ids
