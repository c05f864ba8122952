"""Hidden-state extraction with the HF transformers backend.

The states of eaglenest.states.convention, captured with forward hooks, so no other layer's
state is ever materialised.
"""

import logging
import time

import torch

from eaglenest.states.convention import DTYPES, resolve_aux_layer_ids
from eaglenest.states.shards import write_shard

log = logging.getLogger(__name__)


def load_target(target_dir, dtype, device):
    """Load the target as an HF causal LM in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=DTYPES[dtype])
    return model.to(device).eval()


@torch.no_grad()
def capture_states(model, input_ids, aux_layer_ids):
    """Run one sequence [T] through `model`; return (aux [T, 3H], final [T, H])."""
    layers = model.model.layers
    captured = {}

    def keep_input(k):
        def hook(module, args, kwargs):
            captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def keep_output(module, args, output):
        captured["final"] = output[0] if isinstance(output, tuple) else output

    handles = [layers[k].register_forward_pre_hook(keep_input(k), with_kwargs=True) for k in aux_layer_ids]
    handles.append(layers[-1].register_forward_hook(keep_output))
    try:
        model.model(input_ids=input_ids[None].to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    aux = torch.cat([captured[k][0] for k in aux_layer_ids], dim=-1)
    return aux, captured["final"][0]


def extract_shard(target_dir, samples, shard_path, *, aux_layer_ids, dtype, device):
    """Extract hidden states of `samples` ({"id", "input_ids", "loss_mask"}) into one shard file."""
    model = load_target(target_dir, dtype, device)
    return extract_with(model, samples, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype)


def extract_with(model, samples, shard_path, *, aux_layer_ids, dtype):
    """extract_shard with the target already loaded (for many shards in one process)."""
    aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, model.config.num_hidden_layers)
    rows = []
    start, tokens = time.monotonic(), 0
    for i, sample in enumerate(samples, 1):
        input_ids = torch.tensor(sample["input_ids"], dtype=torch.int64)
        aux, final = capture_states(model, input_ids, aux_layer_ids)
        rows.append(
            {
                "id": sample["id"],
                "input_ids": input_ids,
                "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.bool),
                "aux_hidden_states": aux.to(DTYPES[dtype]).cpu(),
                "final_hidden_states": final.to(DTYPES[dtype]).cpu(),
            }
        )
        tokens += len(input_ids)
        if i % 50 == 0 or i == len(samples):
            rate = tokens / max(time.monotonic() - start, 1e-9)
            eta = (len(samples) - i) * (time.monotonic() - start) / i
            log.info("%s: %d/%d samples, %.0f tok/s, ETA %.0fs", shard_path, i, len(samples), rate, eta)
    write_shard(shard_path, rows, hidden_size=model.config.hidden_size, dtype=DTYPES[dtype])
    return {"num_samples": len(rows), "num_tokens": tokens}
