"""Run eaglenest.engine.generate in its own process (vLLM spawns workers) and print its JSON.

usage: vllm_generate.py TARGET PROMPTS_JSON MAX_TOKENS CONCURRENCY STOP_ID [DRAFTER]
"""

import json
import sys

from eaglenest.engine import generate

if __name__ == "__main__":
    target, prompts, max_tokens, concurrency = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
    stop_id, drafter = int(sys.argv[5]), sys.argv[6] if len(sys.argv) > 6 else None
    vllm = {"dtype": "float32", "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.2,
            "max_model_len": 512, "enforce_eager": True}
    run = generate(target, prompts, vllm, trust_remote_code=False, stop_token_ids=[stop_id], max_tokens=max_tokens,
                   drafter_dir=drafter, max_num_seqs=concurrency)
    print("RESULT " + json.dumps(run))
