"""Engine settings: every one of the config's vllm section (and target.trust_remote_code) reaches
vLLM under vLLM's own name, through the one function every stage builds its engine with."""

import dataclasses

import yaml

from conftest import REPO
from eaglenest.engine.start import ENGINE_ARGS, OPTIONAL_ENGINE_ARGS, engine_args


def test_every_engine_setting_reaches_vllm_under_its_own_name():
    from vllm.engine.arg_utils import EngineArgs

    names = {field.name for field in dataclasses.fields(EngineArgs)}
    assert set(ENGINE_ARGS) | set(OPTIONAL_ENGINE_ARGS) | {"trust_remote_code"} <= names
    schema = yaml.safe_load((REPO / "schemas/config.schema.yaml").read_text())
    assert set(schema["properties"]["vllm"]["properties"]) == set(ENGINE_ARGS) | set(OPTIONAL_ENGINE_ARGS)

    demo = yaml.safe_load((REPO / "config.yaml").read_text())["vllm"]
    assert engine_args(demo, trust_remote_code=False) == {
        key: demo[key] for key in ENGINE_ARGS} | {"trust_remote_code": False}  # optional ones unset: vLLM's defaults
    kimi = demo | {"kv_cache_dtype": "fp8", "max_num_seqs": 64, "max_num_batched_tokens": 8192,
                   "attention_backend": "TRITON_MLA", "tensor_parallel_size": 8}
    args = engine_args(kimi, trust_remote_code=True, max_num_seqs=1, seed=None)  # a stage's own overrides win
    assert args == {key: kimi[key] for key in ENGINE_ARGS} | {
        "trust_remote_code": True, "max_num_seqs": 1, "max_num_batched_tokens": 8192, "attention_backend": "TRITON_MLA"}
