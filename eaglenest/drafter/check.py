"""Pre-flight check of an exported drafter against the target, the vocab and the hidden states.

Cheap (reads configs and weights, runs nothing) and meant to run before any vLLM or GPU stage:
it catches the silent mismatches that load fine and then drag acceptance down (aux layer ids
in another convention, a norm flag that is not the trained one, d2t stored as absolute ids, a
stale vocab, the wrong target), and a config vLLM would read as another model (the MTP case).
"""

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglenest.data.target import target_architectures, target_config
from eaglenest.drafter.export import MLA_ARCHITECTURE
from eaglenest.drafter.load import NORM_FLAGS, read_checkpoint
from eaglenest.states.manifest import read_manifest
from eaglenest.workflow.atomic import write_json
from eaglenest.workflow.errors import InputError


def vocab_problems(d2t, t2d, target_vocab_size):
    """What is wrong with a (d2t offsets [N], t2d mask [V]) pair, as a list of sentences."""
    n = len(d2t)
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        return [f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}"]
    if len(t2d) != target_vocab_size:
        return [f"t2d has {len(t2d)} entries, the target vocab {target_vocab_size}"]
    problems = []
    if int(t2d.sum()) != n:
        problems.append(f"t2d has {int(t2d.sum())} true entries, draft_vocab_size is {n}")
    ids = torch.arange(n) + d2t
    if torch.equal(d2t, t2d.nonzero().flatten()) and n > 1 and d2t[1] > 0:
        problems.append("d2t holds absolute target ids, not offsets (vLLM maps draft i to i + d2t[i])")
    elif not (bool((ids[1:] > ids[:-1]).all()) and int(ids.min()) >= 0 and int(ids.max()) < target_vocab_size):
        problems.append("arange(N) + d2t is not strictly increasing within the target vocab")
    elif not torch.equal(ids, t2d.nonzero().flatten()):
        problems.append("arange(N) + d2t disagrees with the true positions of t2d")
    return problems


def served_model_problems(config):
    """Whether vLLM would read the drafter's config.json (`config`, a dict) as another model: its
    speculative config rewrites a draft config by its model_type before picking the class
    (vllm/config/speculative.py, SpeculativeConfig.hf_config_override: deepseek_v3 becomes
    DeepSeek's MTP head, so an MLA drafter must say deepseek_v2 to stay
    Eagle3DeepseekV2ForCausalLM). Read by vLLM's own code: the speculators format's translation
    (SpeculatorsConfig) and then that rewrite."""
    from transformers import PretrainedConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    read = dict(config)
    if "speculators_model_type" in config:
        try:
            read = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(config)))
        except ValueError as e:
            return [f"vLLM does not read config.json as a speculators drafter: {e}"]
    model_type, architectures = read.get("model_type"), list(read.get("architectures") or [])
    hf_config = PretrainedConfig(**{key: value for key, value in read.items() if key != "model_type"})
    hf_config.model_type = model_type
    rewritten = SpeculativeConfig.hf_config_override(hf_config)
    if list(rewritten.architectures or []) != architectures:
        fix = " (an MLA drafter: model_type deepseek_v2)" if model_type == "deepseek_v3" else ""
        return [f"vLLM would read the drafter's model_type {model_type!r} as {rewritten.model_type} and serve "
                f"{rewritten.architectures}, not {architectures}: write another model_type{fix}"]
    return []


def drafter_problems(drafter_dir, manifest, d2t, t2d, target_dir):
    """Every mismatch between the exported drafter and what it will be served with."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    if served := served_model_problems(config):
        return served
    weights = load_file(str(Path(drafter_dir) / "model.safetensors"))
    target = target_config(target_dir)
    V, H = target["vocab_size"], target["hidden_size"]
    problems = []
    if config.get("architectures") == [MLA_ARCHITECTURE] and config.get("model_type") == "deepseek_v2":
        layer, verifier, flags = config, config.get("verifier", {}), {"norm_before_residual": False, "norm_output": False}
    elif config.get("speculators_model_type") == "eagle3":
        layer, verifier, flags = config.get("transformer_layer_config", {}), config.get("speculators_config", {}).get("verifier", {}), NORM_FLAGS
    else:
        return [f"config.json is neither a speculators-format EAGLE-3 drafter nor a deepseek_v2 {MLA_ARCHITECTURE}"]
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(aux, list) and len(aux) == 3 and len(set(aux)) == 3 and all(0 <= k < target["num_hidden_layers"] for k in aux)):
        problems.append(f"eagle_aux_hidden_state_layer_ids {aux} are not 3 distinct ids in [0, {target['num_hidden_layers']})")
    elif aux != manifest["aux_layer_ids"]:
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {aux} differ from the hidden states' {manifest['aux_layer_ids']} "
            "(vLLM's convention: id k = the input of layer k; SGLang's ids are one lower)"
        )
    for flag in flags:  # vLLM reads an unwritten one as its default, whatever training used
        if not isinstance(config.get(flag), bool):
            problems.append(f"{flag} is not written as true or false (vLLM would read its default, {flags[flag]})")
    if config.get("norm_before_fc") and tuple(getattr(weights.get("input_norm.weight"), "shape", ())) != (3 * H,):
        problems.append(f"norm_before_fc is true but input_norm.weight is not a [{3 * H}] tensor")
    if layer.get("vocab_size") != V or config.get("target_hidden_size") != H:
        problems.append(
            f"vocab/hidden size {layer.get('vocab_size')}/{config.get('target_hidden_size')} differ from the target's {V}/{H}"
        )
    N = config.get("draft_vocab_size")
    shapes = {"lm_head.weight": (N, layer.get("hidden_size")), "fc.weight": (layer.get("hidden_size"), 3 * H), "d2t": (N,), "t2d": (V,)}
    for name, shape in shapes.items():
        if name not in weights or tuple(weights[name].shape) != shape:
            got = tuple(weights[name].shape) if name in weights else "missing"
            problems.append(f"{name} has shape {got}, expected {shape}")
    if "embed_tokens.weight" in weights and tuple(weights["embed_tokens.weight"].shape) != (V, H):
        problems.append(f"embed_tokens.weight has shape {tuple(weights['embed_tokens.weight'].shape)}, expected {(V, H)}")
    if not problems:
        problems += vocab_problems(weights["d2t"], weights["t2d"], V)
    if not problems and not (torch.equal(weights["d2t"], d2t) and torch.equal(weights["t2d"], t2d)):
        problems.append("the drafter's d2t/t2d differ from the current draft vocab (stale drafter)")
    bad = [name for name, w in weights.items() if w.is_floating_point() and not bool(torch.isfinite(w).all())]
    if bad:
        problems.append(f"non-finite weights in {bad}")
    if os.path.realpath(verifier.get("name_or_path", "")) != os.path.realpath(target_dir):
        problems.append(f"the config names verifier {verifier.get('name_or_path')!r}, not the target {str(target_dir)!r}")
    if verifier.get("architectures") != target_architectures(target_dir):
        problems.append(f"the config names verifier architectures {verifier.get('architectures')}, not the target's")
    return problems


def trained_config_problems(drafter_dir, trained):
    """Where the exported config, as read back, differs from the DrafterConfig training used
    (`trained`, a dict): e.g. a flipped norm_before_residual."""
    try:
        exported = read_checkpoint(drafter_dir)[0].to_dict()
    except ValueError as e:
        return [f"config.json does not read back: {e}"]
    return [f"{key} is {exported[key]!r} in config.json, training used {value!r}"
            for key, value in trained.items() if exported.get(key) != value]


def check_drafter(drafter_dir, trained_config_path, manifest_path, d2t_path, t2d_path, target_dir, out_path):
    """Write the check result as JSON, or stop with one line listing every problem found."""
    manifest = read_manifest(manifest_path)
    problems = drafter_problems(drafter_dir, manifest, torch.load(d2t_path), torch.load(t2d_path), target_dir)
    if not problems:  # reading the config back needs a well-formed export
        problems = trained_config_problems(drafter_dir, json.loads(Path(trained_config_path).read_text()))
    if problems:
        raise InputError(f"check_drafter: {drafter_dir}: " + "; ".join(problems))
    write_json(out_path, {"drafter": str(drafter_dir), "target": str(target_dir), "aux_layer_ids": manifest["aux_layer_ids"], "ok": True})
