"""Generation with vLLM's spec-decode counters on a started engine (eaglenest.engine.start):
`generate_with`; at most so many requests at once, `generate_at`; from many threads at once,
`SharedEngine`; its progress as log lines (ProgressLog) instead of vLLM's progress bars."""

import itertools
import logging
import threading
import time

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0  # generate_with(progress=...): a log line at least this often

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "num_accepted_tokens_per_position",
}


def generate_with(llm, prompts, *, stop_token_ids, max_tokens, temperature=0.0, seeds=None, progress=None):
    """Generate for each prompt (a list of token ids) with the started engine `llm` (start_engine)
    and return a dict: token_ids (generated ids per prompt, the end-of-turn token included when it
    stopped there), finish_reasons ("stop" | "length"), counters (vLLM's spec-decode counters
    since the engine started, {} without a drafter), accepted_per_step and drafted_per_step (per
    request, where the engine keeps per_request_spec_decode_metrics "detailed"), generate_s (wall
    time of this generation), generated_tokens, tokens_per_s and vllm_version.

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
    per_request = [o.outputs[0].spec_decode_metrics for o in outputs]
    steps = {"accepted_per_step": [list(m.per_step_accepted) for m in per_request],
             "drafted_per_step": [list(m.per_step_drafted) for m in per_request]} if all(per_request) else {}
    return {
        "token_ids": token_ids,
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "counters": counters,
        **steps,
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
