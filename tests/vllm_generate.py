"""Run an eaglenest function that starts vLLM in its own process (vLLM spawns workers) and print
its JSON result: eaglenest.evaluate.online.vllm_speculative, or this file's eval_run.

usage: vllm_generate.py MODULE.FUNCTION|eval_run CALL_JSON    (CALL_JSON: {"args": [...], "kwargs": {...}})
"""

import importlib
import json
import sys

from eaglenest.engine.start import eagle3_speculative_config
from eaglenest.evaluate.online import EvalEngine
from eaglenest.workflow.stage import end_process


def eval_run(target, prompts, *, drafter, num_speculative_tokens, concurrency, max_tokens, vllm):
    """One greedy run through an evaluation engine (eaglenest.evaluate.online.EvalEngine) with the
    drafter at K: generate_at's dict (token ids, finish reasons, this run's counters)."""
    spec = eagle3_speculative_config(drafter, num_speculative_tokens)
    with EvalEngine(target, vllm, trust_remote_code=False, end_of_turn="<|im_end|>", concurrency=[concurrency],
                    seed=0, speculative_config=spec) as engine:
        return engine.run("heldout", [{"id": str(i), "prompt_token_ids": p} for i, p in enumerate(prompts)], 0.0,
                          concurrency, max_tokens, "eval_run")


if __name__ == "__main__":
    call = json.load(open(sys.argv[2]))
    if sys.argv[1] == "eval_run":
        function = eval_run
    else:
        module, name = sys.argv[1].rsplit(".", 1)
        function = getattr(importlib.import_module(module), name)
    print("RESULT " + json.dumps(function(*call.get("args", []), **call.get("kwargs", {}))))
    end_process()
