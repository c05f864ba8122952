# Environment for the SM120 container (8 PCIe RTX PRO 6000 Blackwell GPUs):
#   source profiles/blackwell/env.sh && snakemake --profile blackwell
# From docs/CONTAINER.md ("The SM120 stack") and docs/GPUS.md; each line says why.

# GPU leases (eaglenest/workflow/gpu_lease.py): the devices Snakemake's jobs share, and the lock files.
export EAGLENEST_GPU_IDS="${EAGLENEST_GPU_IDS:-0,1,2,3,4,5,6,7}"
export EAGLENEST_GPU_LOCK_DIR="${EAGLENEST_GPU_LOCK_DIR:-/tmp/eaglenest-gpu-locks}"

# Tensor parallelism 8 over PCIe: vLLM's custom all-reduce is off beyond two PCIe GPUs, NCCL
# carries it. P2P off with more channels for throughput (NCCL_P2P_LEVEL=SYS instead for latency).
export NCCL_P2P_DISABLE="${NCCL_P2P_DISABLE:-1}"
export NCCL_MIN_NCHANNELS="${NCCL_MIN_NCHANNELS:-32}"
export NCCL_MAX_NCHANNELS="${NCCL_MAX_NCHANNELS:-64}"

# INT4 MoE targets (Kimi) run on Marlin kernels.
export VLLM_MARLIN_USE_ATOMIC_ADD="${VLLM_MARLIN_USE_ATOMIC_ADD:-1}"

# MLA targets (DeepSeek-V3, Kimi): on SM120 only the TRITON_MLA decode backend runs (FlashMLA,
# CUTLASS_MLA and FLASHINFER_MLA are SM90/SM100), and vLLM picks it there by itself. vLLM >= 0.32
# no longer reads VLLM_ATTENTION_BACKEND: vllm.attention_backend in config.yaml (null, or TRITON_MLA
# with an mla drafter layer only: a gqa drafter's layers inherit it and fail; docs/GPUS.md).
