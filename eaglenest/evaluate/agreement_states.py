"""The target's hidden states for the agreement check (eaglenest.evaluate.agreement): taken by the
hidden_states stage's own backend, never by a second copy of the target.

The check replays vLLM's drafting on the baseline's continuations (rule vllm_baseline: at each
suite and temperature's largest concurrency, reference_samples), so it needs the target's aux
states of every such prompt + continuation, and its final state for the target's probabilities
above temperature 0 and its logits where speculation changed greedy text
(eaglenest.evaluate.greedy_identity). At the real target's scale (Kimi-K2.5: 61 layers, ~1T parameters, TP 8)
only the configured backend can produce them, so they come from it with rule hidden_states'
settings: `hidden_states.backend` (vllm: vLLM at the configured tensor parallelism,
eaglenest.states.vllm_extract; hf: transformers on hidden_states.device), hidden_states.dtype, the
vllm section and target.trust_remote_code. They are written in the shard format
(eaglenest.states.shards, loss_mask on the continuation) into files of at most FILE_TOKENS tokens
(a file is what memory holds while writing), with layers.json beside them.

Which layers: the drafter's aux layers (the manifest's) and every layer a misreading of them
would use (one lower, one higher, vLLM's default ids: layer_misreadings), so that a failed check
can still name the misreading without the target. aux_hidden_states concatenates them in
layers.json's `layer_ids` order; AgreementStates.columns picks one reading's.
"""

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from eaglenest.states.convention import default_aux_layer_ids
from eaglenest.states.hf import extract_with, load_target
from eaglenest.states.manifest import read_manifest
from eaglenest.states.shards import ShardSamples
from eaglenest.states.vllm_extract import VllmStateExtractor, token_groups
from eaglenest.workflow.atomic import atomic_dir, write_json
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import read_objects

log = logging.getLogger(__name__)

FILE_TOKENS = 1 << 16  # tokens per states file (Kimi-K2.5, 9 layers + final in bf16: ~9.4 GB)
LAYERS_FILE = "layers.json"


def layer_misreadings(aux_layer_ids, num_layers):
    """The aux layers vLLM could read instead of the trained ones, as (description, ids): one lower
    or one higher (another convention) where in range, vLLM's default ids where they differ."""
    out = []
    for shift in (-1, 1):
        ids = [k + shift for k in aux_layer_ids]
        if all(0 <= k < num_layers for k in ids):
            out.append((f"aux layer ids read as {ids} (trained on {aux_layer_ids}: another convention)", ids))
    default = default_aux_layer_ids(num_layers)
    if default != list(aux_layer_ids):
        out.append((f"aux layer ids read as vLLM's default {default} (trained on {aux_layer_ids})", default))
    return out


def agreement_layer_ids(aux_layer_ids, num_layers):
    """Every layer the check reads, ascending: the trained aux layers and layer_misreadings' ones
    (Kimi-K2.5 with the default (2, 30, 58): 1-3, 29-31, 57-59)."""
    return sorted({*aux_layer_ids, *(k for _, ids in layer_misreadings(aux_layer_ids, num_layers) for k in ids)})


def text_key(suite, temperature, prompt_id):
    """A reference continuation's sample id in the agreement states: `suite/temperature/prompt id`."""
    return f"{suite}/{temperature:g}/{prompt_id}"


def reference_samples(outputs_path):
    """vllm_baseline's continuations at each (suite, temperature)'s largest concurrency (the text the
    offline side replays: every prompt of the suite, of which the smaller concurrencies ran the
    first ones) as samples {"id": text_key, "input_ids", "loss_mask"} (prompt + continuation,
    loss_mask on the continuation), and the texts [{"suite", "temperature", "concurrency",
    "samples"}] in order. After them, as `text_key/c{concurrency}`, every greedy continuation at a
    smaller concurrency that differs from the largest's (an engine not bit-exact: bfloat16), whose
    states judge where speculation changed that run's text (eaglenest.evaluate.greedy_identity)."""
    outputs = list(read_objects(outputs_path))
    top = {}
    for o in outputs:
        key = (o["suite"], o["temperature"])
        top[key] = max(top.get(key, o["concurrency"]), o["concurrency"])
    samples, texts, largest = [], [], {}
    for o in outputs:
        if o["concurrency"] != top[o["suite"], o["temperature"]]:
            continue
        if not texts or (texts[-1]["suite"], texts[-1]["temperature"]) != (o["suite"], o["temperature"]):
            texts.append({"suite": o["suite"], "temperature": o["temperature"], "concurrency": o["concurrency"],
                          "samples": 0})
        texts[-1]["samples"] += 1
        samples.append(_sample(o, text_key(o["suite"], o["temperature"], o["id"])))
        largest[o["suite"], o["temperature"], o["id"]] = o["token_ids"]
    samples += [_sample(o, f"{text_key(o['suite'], 0.0, o['id'])}/c{o['concurrency']}") for o in outputs
                if o["temperature"] == 0 and o["token_ids"] != largest[o["suite"], 0, o["id"]]]
    return samples, texts


def _sample(output, sample_id):
    """A baseline output line as a states sample: prompt + continuation, loss_mask on the continuation."""
    return {"id": sample_id, "input_ids": output["prompt_token_ids"] + output["token_ids"],
            "loss_mask": [0] * len(output["prompt_token_ids"]) + [1] * len(output["token_ids"])}


def extract_files(target_dir, jobs, *, backend, layer_ids, dtype, device, batch_tokens, vllm, trust_remote_code):
    """Each (samples, path) of `jobs` into its shard file, through one instance of the hidden_states
    stage's backend (the same extractor code: eaglenest.states.hf, eaglenest.states.vllm_extract)."""
    if backend == "vllm":
        with VllmStateExtractor(target_dir, aux_layer_ids=layer_ids, dtype=dtype, vllm=vllm,
                                trust_remote_code=trust_remote_code, layer_count=None) as extractor:
            return [extractor.extract_shard(samples, path) for samples, path in jobs]
    model = load_target(target_dir, dtype, device, trust_remote_code=trust_remote_code)
    return [extract_with(model, samples, path, aux_layer_ids=layer_ids, dtype=dtype, batch_tokens=batch_tokens,
                         layer_count=None) for samples, path in jobs]


def extract_agreement_states(outputs_path, manifest_path, target_dir, states_dir, *, backend, dtype, device,
                             batch_tokens, vllm, trust_remote_code, file_tokens=FILE_TOKENS):
    """The target's states of every reference prompt + continuation of `outputs_path` (reference_samples), for the layers
    agreement_layer_ids names, into the folder `states_dir` (replaced whole); -> layers.json's content.
    Settings as extract_shard_part's (rule hidden_states)."""
    manifest = read_manifest(manifest_path)
    layer_ids = agreement_layer_ids(manifest["aux_layer_ids"], manifest["num_layers"])
    samples, texts = reference_samples(outputs_path)
    groups = list(token_groups(samples, file_tokens))
    num_tokens = sum(len(s["input_ids"]) for s in samples)
    log.info("%d prompts + continuations, %d tokens, %s backend, %s: layers %s (trained aux layers %s and "
             "their misreadings), %d file(s)", len(samples), num_tokens, backend, dtype, layer_ids,
             manifest["aux_layer_ids"], len(groups))
    files = [f"states_{i:05d}.safetensors" for i in range(len(groups))]
    with atomic_dir(states_dir) as tmp:
        extract_files(target_dir, [(group, tmp / name) for group, name in zip(groups, files)], backend=backend,
                      layer_ids=layer_ids, dtype=dtype, device=device, batch_tokens=batch_tokens, vllm=vllm,
                      trust_remote_code=trust_remote_code)
        info = {"layer_ids": layer_ids, "aux_layer_ids": list(manifest["aux_layer_ids"]), "backend": backend,
                "dtype": dtype, "hidden_size": manifest["hidden_size"], "files": files, "texts": texts,
                "num_samples": len(samples), "num_tokens": num_tokens}
        write_json(tmp / LAYERS_FILE, info)
    log.info("agreement states: %s", info)
    return info


class AgreementStates:
    """The states extract_agreement_states wrote: samples (shard format) and their layers."""

    def __init__(self, states_dir):
        self.dir = Path(states_dir)
        self.info = json.loads((self.dir / LAYERS_FILE).read_text())
        self.paths = [self.dir / name for name in self.info["files"]]
        self.samples = ShardSamples(self.paths)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]

    def texts(self):
        """[(suite, temperature, sample indices)] of the reference texts, in order."""
        out, start = [], 0
        for text in self.info["texts"]:
            out.append((text["suite"], text["temperature"], range(start, start + text["samples"])))
            start += text["samples"]
        return out

    def columns(self, layer_ids):
        """Indices of aux_hidden_states' columns holding `layer_ids`' states, concatenated in that order."""
        captured, H = self.info["layer_ids"], self.info["hidden_size"]
        if missing := [k for k in layer_ids if k not in captured]:
            raise InputError(f"{self.dir}: layers {missing} were not extracted (only {captured})")
        return torch.cat([torch.arange(captured.index(k) * H, (captured.index(k) + 1) * H) for k in layer_ids])

    def check_text(self, outputs_path):
        """InputError unless these are the states of exactly `outputs_path`'s prompts + continuations."""
        stored = []
        for path in self.paths:
            with safe_open(str(path), framework="pt") as f:
                ids, offsets = json.loads(f.metadata()["sample_ids"]), f.get_tensor("offsets").tolist()
                tokens = f.get_tensor("input_ids").tolist()
            stored += [(i, tokens[a:b]) for i, a, b in zip(ids, offsets, offsets[1:])]
        if stored != [(s["id"], s["input_ids"]) for s in reference_samples(outputs_path)[0]]:
            raise InputError(f"{self.dir}: not the states of {outputs_path}'s prompts and continuations")
