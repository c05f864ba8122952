"""Benchmark: float32 against bfloat16 on this CPU for the real SmolLM2-135M-Instruct (issue 24).

Why configs/smollm2.yaml runs in bfloat16: on a CPU with AMX, bfloat16 matmuls run on its tile
units. Side by side in one run, on a target dir built by build_gguf_target:
  extraction  the HF forward with every hidden state (what the HF backend runs), 4 x 256 tokens, 1 thread
  generation  vLLM greedy generation of the first N prompts of resources/smollm2/prompts.jsonl, <= 128 tokens
Prints a Markdown table of tokens/s and the ratio.

    .venv/bin/python bench/cpu_dtype.py TARGET_DIR [N]
"""

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def extraction(target, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype))
    ids = torch.randint(0, model.config.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids[:1, :32])  # warm-up
        start = time.time()
        model(input_ids=ids, output_hidden_states=True)
    return ids.numel() / (time.time() - start)


def generation(target, dtype, n):
    from vllm import LLM, SamplingParams

    llm = LLM(target, dtype=dtype, gpu_memory_utilization=0.2, max_model_len=1024, enforce_eager=True)
    tok = llm.get_tokenizer()
    lines = (REPO / "resources/smollm2/prompts.jsonl").read_text().splitlines()[:n]
    prompts = [tok.encode(tok.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for line in lines]
    start = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=128, temperature=0, stop_token_ids=[2]), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.time() - start)


if __name__ == "__main__":
    if sys.argv[1] == "--one":  # one measurement in a process of its own (one vLLM engine per process)
        kind, target, dtype, n = sys.argv[2:6]
        rate = extraction(target, dtype) if kind == "extraction" else generation(target, dtype, int(n))
        print(f"RATE {rate:.1f}")
        sys.exit()
    target, n = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "300"
    print("| stage | float32 tok/s | bfloat16 tok/s | bfloat16 / float32 |\n|---|---|---|---|")
    for kind in ("extraction", "generation"):
        rates = []
        for dtype in ("float32", "bfloat16"):
            out = subprocess.run([sys.executable, __file__, "--one", kind, target, dtype, n], capture_output=True,
                                 text=True, check=True).stdout
            rates.append(float(out.split("RATE ")[1].split()[0]))  # vLLM logs to stdout too
        print(f"| {kind} | {rates[0]:.0f} | {rates[1]:.0f} | {rates[1] / rates[0]:.2f} |")
