"""Which config settings define an artifact and which only change speed or placement
(stdlib only: the Snakefile imports this).

A rule's `params` are what Snakemake compares to decide a rerun, so they carry the settings that
define its artifacts and nothing else: changing how fast or where a stage runs must not rebuild
hours of GPU work. A stage reads the others from the config when it runs. The split, with the
why of each, is in docs/REBUILDING.md.
"""

# Settings that change only speed or placement; results stay equal within float rounding.
SPEED_ONLY = {
    # vLLM: how many GPUs, how much of their memory, batch limits, graphs and kernels
    "vllm": ("tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "attention_backend",
             "max_num_seqs", "max_num_batched_tokens"),
    # training: where, in how many processes, how often a resume checkpoint is written, how the
    # shards are read, whether activations are recomputed, bf16 autocast
    "train": ("device", "num_processes", "checkpoint_every", "num_workers", "pin_memory", "activation_checkpointing",
              "bf16"),
    "eval": ("max_tokens_per_batch",),  # evaluate_offline's padded tokens per forward
    "hidden_states": ("device", "batch_tokens", "free_disk_margin_gb"),
}


def artifact_settings(config, section):
    """The settings of config `section` that define artifacts: the section without its
    SPEED_ONLY keys (a rule's params entry)."""
    return {key: value for key, value in config[section].items() if key not in SPEED_ONLY.get(section, ())}
