"""The hidden_states stage for one shard: its part's samples through the configured backend."""

import logging
from pathlib import Path

from eaglenest.data.target import target_config
from eaglenest.engine.service import engine_service
from eaglenest.states.convention import resolve_aux_layer_ids
from eaglenest.states.disk import GB, bytes_to_write, check_free_disk
from eaglenest.states.hf import extract_shard
from eaglenest.states.parts import read_part
from eaglenest.states.vllm_extract import EXTRACTOR, write_empty_shard
from eaglenest.workflow.atomic import atomic_path

log = logging.getLogger(__name__)


def extract_shard_part(part_path, target_dir, shard_path, *, backend, aux_layer_ids, dtype, device, batch_tokens, vllm,
                       trust_remote_code, engine_log, free_disk_margin_gb):
    """The samples of `part_path`, extracted into `shard_path`.

    backend "hf": transformers on `device`, `batch_tokens` padded tokens per forward; "vllm": the
    target in vLLM with the `vllm` settings (tensor parallelism for targets one GPU cannot hold),
    see eaglenest.states.vllm_extract, in this run's hidden_states engine service (one target
    load for all shards, its log in `engine_log`; eaglenest.engine.service).
    trust_remote_code (config target.trust_remote_code): whether the target's own code may run.
    Refuses to start when the disk cannot take the shards still to write, plus
    `free_disk_margin_gb` (eaglenest.states.disk).
    """
    tc = target_config(target_dir)
    needed = bytes_to_write(Path(part_path).parent, Path(shard_path).parent, hidden_size=tc["hidden_size"],
                            dtype=dtype,
                            aux_layers=len(resolve_aux_layer_ids(aux_layer_ids, tc["num_hidden_layers"])))
    free = check_free_disk(needed, Path(shard_path).parent, free_disk_margin_gb)
    log.info("disk: %.2f GB free, %.2f GB of shards still to write", free / GB, needed / GB)
    samples = read_part(part_path)
    log.info("%s: %d samples, %s backend", part_path, len(samples), backend)
    if backend == "vllm":
        if not samples:  # an empty shard needs no engine
            return write_empty_shard(target_dir, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype)
        settings = {"target_dir": str(target_dir), "aux_layer_ids": aux_layer_ids, "dtype": dtype, "vllm": vllm,
                    "trust_remote_code": trust_remote_code}
        # The service writes a temporary that this job renames: the shard appears only when its job completes.
        with atomic_path(shard_path) as staging, engine_service("hidden_states", EXTRACTOR, settings,
                                                                log_path=engine_log) as call:
            return call("extract_shard", samples, str(staging), str(shard_path))
    return extract_shard(target_dir, samples, shard_path, aux_layer_ids=aux_layer_ids, dtype=dtype, device=device,
                         trust_remote_code=trust_remote_code, batch_tokens=batch_tokens)
