"""The vLLM worker extension that captures hidden states inside vLLM's model (config
`hidden_states.backend: vllm`; the driver side is eaglenest.states.vllm_extract).

`LLM(worker_extension_cls=WORKER_EXTENSION)` mixes HiddenStatesWorker into vLLM's worker; its
methods hook the decoder layers and keep, per forward step, the states of
eaglenest.states.convention, read back by the driver with `llm.collective_rpc`.

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

Only TP rank 0 keeps and returns states (the residual stream is replicated over TP ranks).
Pipeline parallelism is refused (no rank holds all layers).

Imports: vLLM resolves the worker extension by its qualified name,
"eaglenest.states.vllm_worker.HiddenStatesWorker", in its engine and worker processes. Those are
started with multiprocessing, which hands them the parent's sys.path (spawn, checked with
eaglenest on sys.path only) or its memory (fork); the engine is also started with this
eaglenest first on PYTHONPATH, for processes that see only the environment.
"""

import torch

from eaglenest.states.shards import quantize_fp8

WORKER_EXTENSION = "eaglenest.states.vllm_worker.HiddenStatesWorker"


def _to_host(tensor, dtype=None):
    """A host copy of `tensor` that does not stall the GPU: on CUDA, into pinned memory with a
    non-blocking copy queued behind the step's kernels (take() waits for them once per read-back,
    not once per layer); elsewhere a plain copy."""
    tensor = tensor.detach()
    if not tensor.is_cuda:
        return tensor.to("cpu", dtype, copy=True)
    if dtype is not None:
        tensor = tensor.to(dtype)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _decoder(model):
    """The decoder stack (`.layers`, `.embed_tokens`) of a vLLM model; a multimodal wrapper's text model."""
    if hasattr(model, "get_language_model"):
        model = model.get_language_model()
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise TypeError(f"{type(model).__name__}: no decoder layers at .model.layers")
    return inner


class _Capture:
    """Hooks on one vLLM model that keep, per forward step, positions, token ids, aux and final
    states, and the step's request layout (`spans`): [request ordinal, first row, end row] per
    sequence, from the model runner's batch (its requests in row order, `query_start_loc`), read
    when the step's first hook runs. The ordinal is the number LLM.generate gave the request (its
    id before vLLM's random suffix), so the driver maps rows to samples without guessing."""

    def __init__(self, model, aux_layer_ids, runner, quantize=False):
        self.runner = runner
        self.quantize = quantize  # FP8 with per-token scales on the device, before the host copy
        inner = _decoder(model)
        layers = inner.layers
        self.num_layers = len(layers)
        self.aux_layer_ids = list(aux_layer_ids)
        self.steps = []
        self.pending = False  # host copies queued on the GPU and not yet waited for
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
        self._ids = _to_host(ids, torch.int64) if isinstance(ids, torch.Tensor) else None

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
                self._step = {"positions": _to_host(positions, torch.int64), "aux": {},
                              "spans": self._spans(hidden.shape[0])}
            # quantizing: kept on the device (a copy: the fused norm overwrites its inputs) until the
            # last layer, as one scale per token covers all aux layers
            self._step["aux"][k] = stream.clone() if self.quantize else _to_host(stream)

        return hook

    def _spans(self, num_rows):
        batch = self.runner.input_batch
        n = batch.num_reqs
        starts = [int(x) for x in self.runner.query_start_loc.np[: n + 1]]
        if starts[0] != 0 or starts[-1] > num_rows:
            raise RuntimeError(f"the runner's batch ({starts}) does not lay out this step's {num_rows} rows")
        return torch.tensor([[int(req_id.split("-")[0]), a, b]
                             for req_id, a, b in zip(batch.req_ids[:n], starts, starts[1:])], dtype=torch.int64)

    def _keep_output(self, module, args, kwargs, output):
        hidden, residual = output if isinstance(output, tuple) else (output, None)
        stream = hidden if residual is None else hidden + residual
        step, self._step = self._step, None
        if step is None:  # no aux layer seen this step (cannot happen: ids are < num_layers)
            raise RuntimeError("final state without aux states")
        n = step["positions"].shape[-1]
        ids, self._ids = self._ids, None
        kept = {"spans": step["spans"], "positions": step["positions"],
                "input_ids": ids if ids is not None and ids.shape[0] == n else None}
        aux = [step["aux"][k] for k in self.aux_layer_ids]
        if self.quantize:  # half the bytes of bf16 cross to the host
            (aux, aux_scale), (final, final_scale) = quantize_fp8(torch.cat(aux, dim=-1)), quantize_fp8(stream)
            kept |= {"aux": [_to_host(aux)], "aux_scale": _to_host(aux_scale),
                     "final": _to_host(final), "final_scale": _to_host(final_scale)}
        else:
            kept |= {"aux": [_to_host(a) for a in aux], "final": _to_host(stream)}  # aux concatenated once landed
        self.steps.append(kept)
        if stream.is_cuda:
            self.pending = True

    def take(self):
        if self.pending:  # the queued host copies must have landed before the rows are read
            torch.cuda.synchronize()
            self.pending = False
        steps, self.steps = self.steps, []
        for step in steps:
            step["aux"] = torch.cat(step["aux"], dim=-1)
        return [{key: pack(value) for key, value in step.items()} for step in steps]

    def remove(self):
        for handle in self.handles:
            handle.remove()


def pack(tensor):
    """A tensor as plain msgpack types: vLLM returns collective_rpc results without type
    information (unless VLLM_ALLOW_INSECURE_SERIALIZATION), which would lose a tensor's data."""
    if tensor is None:
        return None
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": tensor.contiguous().view(torch.uint8).numpy().tobytes()}


def unpack(packed):
    """A tensor from pack's plain types."""
    if packed is None:
        return None
    data = torch.frombuffer(bytearray(packed["data"]), dtype=torch.uint8)
    return data.view(getattr(torch, packed["dtype"])).reshape(packed["shape"])


class HiddenStatesWorker:
    """vLLM worker extension: `eaglenest_*` methods called on every worker with collective_rpc.

    Mixed into vLLM's worker class, so `self` is the worker (self.model_runner). Only TP rank 0
    hooks the model and returns states; other ranks return None.
    """

    def eaglenest_start_capture(self, aux_layer_ids, quantize=False):
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        if get_pp_group().world_size != 1:
            raise ValueError("hidden-state extraction needs every layer on one rank: no pipeline parallelism")
        model = self.model_runner.get_model()
        if get_tensor_model_parallel_rank() != 0:
            return None
        self._eaglenest_capture = _Capture(model, aux_layer_ids, self.model_runner, quantize)
        inner = _decoder(model)
        return {"num_layers": self._eaglenest_capture.num_layers, "model": type(model).__name__,
                "dtype": str(next(inner.parameters()).dtype).removeprefix("torch.")}

    def eaglenest_take_states(self):
        capture = getattr(self, "_eaglenest_capture", None)
        return None if capture is None else capture.take()
