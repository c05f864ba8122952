"""The hidden_states stage for one shard: its part's samples through the configured backend."""

import logging

from eaglenest.states.hf import extract_shard
from eaglenest.states.parts import read_part
from eaglenest.states.vllm_extract import extract_shard_vllm

log = logging.getLogger(__name__)


def extract_shard_part(part_path, target_dir, shard_path, *, backend, aux_layer_ids, dtype, device, batch_tokens, vllm,
                       trust_remote_code):
    """The samples of `part_path`, extracted into `shard_path`.

    backend "hf": transformers on `device`, `batch_tokens` padded tokens per forward; "vllm": the target in vLLM with the `vllm` settings
    (tensor parallelism for targets one GPU cannot hold), see eaglenest.states.vllm_extract.
    trust_remote_code (config target.trust_remote_code): whether the target's own code may run.
    """
    samples = read_part(part_path)
    log.info("%s: %d samples, %s backend", part_path, len(samples), backend)
    if backend == "vllm":
        return extract_shard_vllm(target_dir, samples, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype, vllm=vllm,
                                  trust_remote_code=trust_remote_code)
    return extract_shard(target_dir, samples, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype, device=device,
                         trust_remote_code=trust_remote_code, batch_tokens=batch_tokens)
