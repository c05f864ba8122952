"""Run eaglenest.vllm_run.greedy_generate in its own process (vLLM spawns workers) and print JSON.

usage: vllm_generate.py TARGET PROMPTS_JSON MAX_TOKENS [DRAFTER]
"""

import json
import sys

from eaglenest.vllm_run import greedy_generate

if __name__ == "__main__":
    target, prompts, max_tokens = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
    drafter = sys.argv[4] if len(sys.argv) > 4 else None
    tokens, counters = greedy_generate(target, prompts, max_tokens=max_tokens, drafter_dir=drafter)
    print("RESULT " + json.dumps({"tokens": tokens, "counters": counters}))
