"""Benchmark: peak memory of one drafter training step against sequence length T, with the
full-matrix TTT attention ("before") and the blocked, checkpointed one ("after").

One training step: `Drafter.forward` with K=3 TTT steps, a soft cross-entropy of the logits
against fixed random target distributions, backward. Small width (hidden 256, 4 heads and 2 KV
heads of 64, intermediate 688, draft vocab 2,000, target vocab 4,000), batch 1, CPU, float32.
"before" is the attention as it was (its copy is below), swapped into eaglenest.drafter.model.

Each (T, attention) runs in a fresh process, so no peak carries over. The figure is the step's
peak RSS above the RSS after building the model and the inputs: the process resets its RSS
high-water mark there (/proc/self/clear_refs) and reads VmHWM after the step. ru_maxrss cannot
be reset, so the import's and the model build's peaks would hide a smaller step. A warm-up
step at T=16 first keeps one-time allocations (thread pools, kernels, lazy imports) out of the
figure. glibc's malloc runs with a fixed mmap threshold of 64 kB (MALLOC_MMAP_THRESHOLD_):
every tensor buffer is then its own mapping, returned to the system when freed, so RSS follows
the live tensors. With the default, moving threshold, freed buffers stay in malloc's heap and
the figure depends on the order of allocations (three steps of T=1024 in one process: 290, 150, 0 MB).
"before" at the longest T is skipped when its extrapolation (a + bT² through the two previous
lengths) would need more than MAX_BEFORE_GB or most of the free memory.

    .venv/bin/python bench/train_memory.py    # prints a Markdown table (~5 min on 2 cores)
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglenest.drafter import model  # noqa: E402
from eaglenest.drafter.model import repeat_kv  # noqa: E402

LENGTHS = [512, 1024, 2048, 4096, 8192]
TTT_STEPS = 3
MAX_BEFORE_GB = 12
MB = 2**20


def full_matrix_ttt_attention(q, keys, values):
    """ttt_attention before blocks: the whole [B, nh, T, T + k] score matrix, kept for backward."""
    B, T, nh, D = q.shape
    q = q.transpose(1, 2) / math.sqrt(D)  # [B, nh, T, D]
    k0 = repeat_kv(keys[0], nh).transpose(1, 2)  # [B, nh, T, D]
    v0 = repeat_kv(values[0], nh).transpose(1, 2)
    causal = q @ k0.transpose(-1, -2)  # [B, nh, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    causal = causal.masked_fill(future, float("-inf"))
    diagonal = [(q * repeat_kv(k, nh).transpose(1, 2)).sum(-1, keepdim=True) for k in keys[1:]]
    scores = torch.cat([causal, *diagonal], dim=-1)  # [B, nh, T, T + k]
    probs = scores.float().softmax(-1).to(q.dtype)
    out = probs[..., :T] @ v0  # [B, nh, T, D]
    for s, v in enumerate(values[1:]):
        out = out + probs[..., T + s, None] * repeat_kv(v, nh).transpose(1, 2)
    return out.transpose(1, 2)


def rss_kb(field):
    """VmRSS or VmHWM (the RSS high-water mark) of this process, in kB."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def training_step(drafter, input_ids, aux, targets):
    """Forward of the K TTT steps, soft cross-entropy against `targets` [B, T, N] each, backward."""
    logits = drafter(input_ids, aux, TTT_STEPS)  # K x [B, T, N]
    loss = sum(-(t * step.log_softmax(-1)).sum(-1).mean() for t, step in zip(targets, logits))
    loss.backward()


def step_inputs(T):
    """input_ids [1, T], aux [1, T, 3 * 256] and K target distributions [1, T, 2000]."""
    g = torch.Generator().manual_seed(T)
    targets = [torch.randn(1, T, 2000, generator=g).softmax(-1) for _ in range(TTT_STEPS)]
    return torch.randint(0, 4000, (1, T), generator=g), torch.randn(1, T, 3 * 256, generator=g), targets


def measure(T, attention):
    """In this process: the peak MB of one training step of length T above the RSS after
    building, and its seconds. `attention` is "before" or "after"."""
    if attention == "before":
        model.ttt_attention = full_matrix_ttt_attention
    torch.manual_seed(0)
    config = model.DrafterConfig(target_vocab_size=4000, draft_vocab_size=2000, hidden_size=256,
                                 target_hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, aux_layer_ids=[1, 2, 3])
    drafter = model.Drafter(config)
    training_step(drafter, *step_inputs(16))  # warm-up; its gradients stay, as in training
    inputs = step_inputs(T)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = rss_kb("VmRSS")
    start = time.perf_counter()
    training_step(drafter, *inputs)
    return {"mb": (rss_kb("VmHWM") - base) * 1024 / MB, "seconds": time.perf_counter() - start}


def run_measure(T, attention):
    """measure(T, attention) in a fresh interpreter."""
    out = subprocess.run([sys.executable, __file__, "--measure", str(T), attention], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    if out.returncode != 0:
        raise SystemExit(f"T={T} {attention} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def quadratic_estimate_mb(measured, T):
    """a·T' + b·T'² through the last two measured lengths, at T."""
    (t1, m1), (t2, m2) = list(measured.items())[-2:]
    b = (m2 / t2 - m1 / t1) / (t2 - t1)
    a = m1 / t1 - b * t1
    return a * T + b * T * T


def main():
    rows, before = [], {}
    for T in LENGTHS:
        old = None
        if len(before) >= 2:
            need_mb = quadratic_estimate_mb(before, T)
            available_mb = int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) / 1024
            if need_mb > min(MAX_BEFORE_GB * 1024, 0.7 * available_mb):
                old = {"mb": f"not run (would need ~{need_mb / 1024:.0f} GB)", "seconds": "-"}
        if old is None:
            old = run_measure(T, "before")
            before[T] = old["mb"]
            old = {"mb": f"{old['mb']:,.0f}", "seconds": f"{old['seconds']:.1f}"}
        new = run_measure(T, "after")
        rows.append(f"| {T:,} | {old['mb']} | {new['mb']:,.0f} | {new['mb'] / T * 1000:.1f} | {old['seconds']} "
                    f"| {new['seconds']:.1f} |")
    print("| T | before MB | after MB | after MB per 1,000 tokens | before s | after s |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        print(json.dumps(measure(int(sys.argv[2]), sys.argv[3])))
    else:
        main()
