"""Run an eaglenest function that starts vLLM in its own process (vLLM spawns workers) and print
its JSON result: eaglenest.engine.generate, eaglenest.evaluate.online.vllm_speculative, ...

usage: vllm_generate.py MODULE.FUNCTION CALL_JSON    (CALL_JSON: {"args": [...], "kwargs": {...}})
"""

import importlib
import json
import sys

if __name__ == "__main__":
    module, name = sys.argv[1].rsplit(".", 1)
    call = json.load(open(sys.argv[2]))
    result = getattr(importlib.import_module(module), name)(*call.get("args", []), **call.get("kwargs", {}))
    print("RESULT " + json.dumps(result))
