"""Hidden-state extraction with the HF transformers backend.

The states of eaglenest.states.convention, captured with forward hooks, so no other layer's
state is ever materialised.
"""

import logging
import re
import time

import torch

from eaglenest.data.target import target_config, target_is_wrapped, target_ties_embeddings, target_weight_prefix
from eaglenest.states.convention import DTYPES, compute_dtype, resolve_aux_layer_ids
from eaglenest.states.shards import length_batches, stored, write_shard
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)
BATCH_TOKENS = 4096  # padded tokens per forward: a few sequences at once, memory bounded

# Text model types that transformers knows under another name: Kimi-K2.5's text_config says
# kimi_k2 (its remote code's DeepSeek-V3), which transformers' own Kimi-K2.5 config reads as deepseek_v3.
TEXT_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}


def text_model_config(target_dir):
    """The transformers config of a wrapped target's text model, built from `text_config` with
    transformers' own classes (the wrapper's remote code is never run: it would build the vision
    tower too). Its tie_word_embeddings is the one eaglenest.data.target reads."""
    from transformers import AutoConfig, __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = dict(target_config(target_dir))
    text.pop("auto_map", None)  # the text model's classes are transformers', not the target's code
    named = text.pop("model_type", None)
    model_type = TEXT_MODEL_TYPES.get(named, named)
    if model_type not in CONFIG_MAPPING:
        raise InputError(
            f"{target_dir}/config.json: text_config.model_type {named!r} is not a model type of transformers "
            f"{__version__}, so the HF backend cannot build the target's text model. If transformers has that "
            f"architecture under another name, set text_config.model_type to it in the target's config.json "
            f"(e.g. 'deepseek_v3' for a DeepSeek-V3 text model); otherwise use a transformers that knows it.")
    return AutoConfig.for_model(model_type, **{**text, "tie_word_embeddings": target_ties_embeddings(target_dir)})


def load_target(target_dir, dtype, device, *, trust_remote_code):
    """Load the target's text model as an HF causal LM in eval mode, in the dtype that states
    stored in `dtype` are computed in (convention.compute_dtype).

    A multimodal wrapper (Kimi-K2.5) loads as its text model alone: the config from text_config
    (text_model_config), the weights with their prefix mapped off, the vision tensors left
    unused. trust_remote_code (config target.trust_remote_code) lets a plain target's own model
    code (auto_map) run. A checkpoint that lacks any of the model's weights is refused, where
    transformers would initialise them at random.
    """
    from transformers import AutoModelForCausalLM

    wrapper = {}
    if target_is_wrapped(target_dir):
        config = text_model_config(target_dir)
        prefix = target_weight_prefix(target_dir)
        wrapper = {"config": config, "key_mapping": {"^" + re.escape(prefix): ""} if prefix else None}
    model, info = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=DTYPES[compute_dtype(dtype)], trust_remote_code=trust_remote_code, output_loading_info=True, **wrapper)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise InputError(f"{target_dir}: the checkpoint lacks {len(missing)} of the model's weights, "
                         f"e.g. {missing[:3]}")
    return model.to(device).eval()


@torch.no_grad()
def capture_states(model, input_ids, aux_layer_ids):
    """Run one sequence [T] through `model`; return (aux [T, 3H], final [T, H])."""
    return capture_batch(model, [input_ids], aux_layer_ids)[0]


def right_padded(sequences):
    """(input_ids [B, longest], attention_mask [B, longest]) of 1-D id tensors, padded on the right."""
    input_ids = torch.zeros(len(sequences), max(len(ids) for ids in sequences), dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)], mask[row, : len(ids)] = ids, 1
    return input_ids, mask


@torch.no_grad()
def capture_batch(model, sequences, aux_layer_ids):
    """Run `sequences` (1-D id tensors) through `model` in one forward, right-padded with an
    attention mask (a causal model's real tokens never see the padding); return each one's
    (aux [T, 3H], final [T, H]), padding cut off."""
    lengths = [len(ids) for ids in sequences]
    input_ids, mask = right_padded(sequences)
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
        model.model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    aux = torch.cat([captured[k] for k in aux_layer_ids], dim=-1)
    return [(aux[row, :n], captured["final"][row, :n]) for row, n in enumerate(lengths)]


def extract_shard(target_dir, samples, shard_path, *, aux_layer_ids, dtype, device, trust_remote_code,
                  batch_tokens=BATCH_TOKENS):
    """Extract hidden states of `samples` ({"id", "input_ids", "loss_mask"}) into one shard file."""
    model = load_target(target_dir, dtype, device, trust_remote_code=trust_remote_code)
    return extract_with(model, samples, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype,
                        batch_tokens=batch_tokens)


def extract_with(model, samples, shard_path, *, aux_layer_ids, dtype, batch_tokens=BATCH_TOKENS, layer_count=3):
    """extract_shard with the target already loaded (for many shards in one process). Samples
    go through in padded batches of at most `batch_tokens`, formed in order of length so that
    little is padding, and are written in their own order (speed only: the states equal
    one-at-a-time extraction within float rounding). layer_count: see resolve_aux_layer_ids."""
    aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, model.config.num_hidden_layers, layer_count)
    rows, done = [None] * len(samples), 0
    start, tokens = time.monotonic(), 0
    for indices in length_batches(range(len(samples)), [len(sample["input_ids"]) for sample in samples], batch_tokens):
        batch = [samples[i] for i in indices]
        sequences = [torch.tensor(sample["input_ids"], dtype=torch.int64) for sample in batch]
        states = capture_batch(model, sequences, aux_layer_ids)
        for index, sample, input_ids, (aux, final) in zip(indices, batch, sequences, states):
            kept = stored({"aux_hidden_states": aux, "final_hidden_states": final}, DTYPES[dtype])  # on the device
            rows[index] = {"id": sample["id"], "input_ids": input_ids,
                           "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.bool)}
            rows[index] |= {key: value.cpu() for key, value in kept.items()}
            tokens += len(input_ids)
        done += len(batch)
        elapsed = max(time.monotonic() - start, 1e-9)
        log.info("%s: %d/%d samples, %.0f tok/s, ETA %.0fs", shard_path, done, len(samples), tokens / elapsed,
                 (len(samples) - done) * elapsed / done)
    write_shard(shard_path, rows, hidden_size=model.config.hidden_size, dtype=DTYPES[dtype],
                aux_layers=len(aux_layer_ids))
    return {"num_samples": len(rows), "num_tokens": tokens}
