"""The plan rule: from the tokenized data (exact token counts) and the config, what extraction
and training will take, written as results/plan.json and a readable plan.md before either starts.

Sizes are computed, not measured: hidden_states_bytes from the shards' layout
(eaglenest.states.shards.shard_bytes), training memory from the memory model
(eaglenest.train.memory, docs/MEMORY.md), for the drafter training will build
(planned_drafter_config). Times are estimates from measured rates (eaglenest.plan.rates).
"""

import json
import logging
import shutil
from collections import Counter
from pathlib import Path

from eaglenest.data.samples import is_heldout
from eaglenest.data.target import target_config, target_embedding_bytes, target_ties_embeddings
from eaglenest.plan.rates import stage_times
from eaglenest.states.convention import DTYPES, compute_dtype, resolve_aux_layer_ids
from eaglenest.states.disk import existing_folder
from eaglenest.states.parts import shard_of
from eaglenest.states.shards import bytes_per_token, shard_bytes
from eaglenest.train.init_drafter import planned_drafter_config
from eaglenest.train.memory import training_memory
from eaglenest.workflow.atomic import atomic_path, write_json
from eaglenest.workflow.device import torch_device
from eaglenest.workflow.jsonl import read_objects
from eaglenest.workflow.units import GB, duration, size

log = logging.getLogger(__name__)

def sample_counts(tokenized_path, num_shards, heldout_fraction):
    """From tokenized_data.jsonl, read once here for the plan and the report: per shard [samples,
    tokens], the generated (loss_mask) tokens of the training split, which one epoch supervises,
    and the sample lengths as {"tokens", "generated"}: [[length, samples], ...] by length."""
    shards = [[0, 0] for _ in range(num_shards)]
    supervised, tokens, generated = 0, Counter(), Counter()
    for sample in read_objects(tokenized_path):
        n, g = len(sample["input_ids"]), sum(sample["loss_mask"])
        shard = shards[shard_of(sample["id"], num_shards)]
        shard[0] += 1
        shard[1] += n
        tokens[n] += 1
        generated[g] += 1
        if not is_heldout(sample["id"], heldout_fraction):
            supervised += g
    return shards, supervised, {"tokens": sorted(map(list, tokens.items())),
                                "generated": sorted(map(list, generated.items()))}


def extraction_ram(largest_shard_bytes, target_dir, hidden_states):
    """Host bytes of the process that extracts a shard (the job on HF; the hidden_states engine
    service on vLLM): the shard's states twice (the samples' rows, then the file's concatenated
    tensors) and, on HF on the CPU, the target's weights in the dtype it computes the states in."""
    ram = 2 * largest_shard_bytes
    if hidden_states["backend"] == "hf" and hidden_states["device"] == "cpu":
        stored = sum(p.stat().st_size for p in Path(target_dir).glob("*.safetensors"))
        ram += stored * DTYPES[compute_dtype(hidden_states["dtype"])].itemsize // target_embedding_bytes(target_dir)
    return ram


def training_process_memory(target_dir, *, hidden_states, train, drafter, draft_vocab_size, longest):
    """The memory model's bytes for one training process: the worst micro-batch (the longest
    sample, in a batch of max_tokens_per_batch or alone when longer), on the device training
    will use, with its bf16, checkpointing and DDP settings and the recipe's optimizer, lm_head and
    total variation term."""
    config = planned_drafter_config(target_dir, aux_layer_ids=hidden_states["aux_layer_ids"],
                                    draft_vocab_size=draft_vocab_size, init_from=train["init_from"],
                                    geometry=drafter)
    device = torch_device(train["device"]).type
    autocast = train["bf16"] if train["bf16"] is not None else device == "cuda"
    terms = training_memory(
        config, target_dtype_bytes=target_embedding_bytes(target_dir),
        tokens=max(train["max_tokens_per_batch"], longest), longest=longest, ttt_steps=train["ttt_steps"],
        activation_checkpointing=train["activation_checkpointing"], autocast_bf16=autocast,
        stored_dtype_bytes=DTYPES[hidden_states["dtype"]].itemsize, tied_embeddings=target_ties_embeddings(target_dir),
        distributed=train["num_processes"] > 1, device=device, optimizer=train["optimizer"],
        train_lm_head=train["train_lm_head"], tv_weight=train["tv_weight"])
    return terms, device, autocast


def make_plan(tokenized_path, report, target_dir, *, results, benchmarks, hidden_states, train, drafter,
              draft_vocab_size, rates):
    """The plan as a dict (plan.json): see docs/CONTRACTS.md."""
    tc = target_config(target_dir)
    hidden, dtype = tc["hidden_size"], hidden_states["dtype"]
    aux = len(resolve_aux_layer_ids(hidden_states["aux_layer_ids"], tc["num_hidden_layers"]))
    shards, supervised, lengths = sample_counts(tokenized_path, hidden_states["num_shards"], train["heldout_fraction"])
    longest = max((n for n, _ in lengths["tokens"]), default=0)
    per_shard = [shard_bytes(tokens, samples, hidden_size=hidden, dtype=dtype, aux_layers=aux)
                 for samples, tokens in shards]
    folder = Path(results, "hidden_states")
    memory, device, autocast = training_process_memory(target_dir, hidden_states=hidden_states, train=train,
                                                       drafter=drafter, draft_vocab_size=draft_vocab_size,
                                                       longest=longest)
    return {
        "samples": report["samples_out"],
        "tokens": report["tokens"],
        "generated_tokens": report["generated_tokens"],
        "truncated_samples": report["truncated"],
        "longest_sample": longest,
        "sample_lengths": lengths,
        "hidden_states_bytes": sum(per_shard),
        "hidden_states_bytes_per_token": bytes_per_token(hidden_size=hidden, dtype=dtype, aux_layers=aux),
        "hidden_states_dir": str(folder),
        "free_disk_bytes": shutil.disk_usage(existing_folder(folder)).free,
        "free_disk_margin_bytes": int(hidden_states["free_disk_margin_gb"] * GB),
        "shards": [{"samples": s, "tokens": t, "bytes": b} for (s, t), b in zip(shards, per_shard)],
        "extraction_host_ram_bytes": extraction_ram(max(per_shard), target_dir, hidden_states),
        "training_gpu_memory_bytes": memory["peak"],
        "training_memory": {"device": device, "bf16_autocast": autocast, "processes": train["num_processes"],
                            "micro_batch_tokens": max(train["max_tokens_per_batch"], longest),
                            "terms": {key: value for key, value in memory.items() if not key.startswith("at_")}},
        "stages": stage_times(results=results, benchmarks=benchmarks, generated_tokens=report["generated_tokens"],
                              tokens=report["tokens"], supervised_per_epoch=supervised, epochs=train["epochs"],
                              rates=rates),
    }


def plan_markdown(plan):
    """plan.md: the plan for a person."""
    memory = plan["training_memory"]
    lines = [
        "# Plan",
        "",
        f"- **Data:** {plan['samples']:,} samples, {plan['tokens']:,} tokens, {plan['generated_tokens']:,} of them "
        f"generated; {plan['truncated_samples']:,} truncated; longest {plan['longest_sample']:,} tokens.",
        f"- **Hidden states:** {size(plan['hidden_states_bytes'])} in {len(plan['shards'])} shards "
        f"({plan['hidden_states_bytes_per_token']:,} bytes per token) under `{plan['hidden_states_dir']}`, where "
        f"{size(plan['free_disk_bytes'])} are free (extraction refuses to start below what it needs plus "
        f"{size(plan['free_disk_margin_bytes'])}).",
        f"- **Host RAM per extraction job:** {size(plan['extraction_host_ram_bytes'])}.",
        f"- **Training memory per process ({memory['device']}, {memory['processes']} process(es), bf16 autocast "
        f"{'on' if memory['bf16_autocast'] else 'off'}):** {size(plan['training_gpu_memory_bytes'])} at the "
        f"largest micro-batch ({memory['micro_batch_tokens']:,} tokens), from the memory model (docs/MEMORY.md).",
        "",
        "## Time per stage (estimates, but for what this run measured)",
        "",
        "| stage | work | rate | from | time |",
        "|---|---|---|---|---|",
    ]
    for s in plan["stages"]:
        rate = f"{s['rate']:,.0f} {s['unit']}/s" if s["rate"] else "unknown"
        when = "measured" if s.get("measured") else "estimate"
        source = s["rate_source"] or "no rate yet: an earlier run or config plan.rates gives one"
        lines.append(f"| {s['stage']} | {s['work']:,} {s['unit']} | {rate} | {source} | {'unknown' if s['estimate_s'] is None else duration(s['estimate_s'])} "
                     f"({when}) |")
    return "\n".join(lines) + "\n"


def write_plan(tokenized_path, report_path, target_dir, plan_json, plan_md, **settings):
    """The plan rule: plan.json and plan.md, atomically."""
    plan = make_plan(tokenized_path, json.loads(Path(report_path).read_text()), target_dir, **settings)
    write_json(plan_json, plan)
    with atomic_path(plan_md) as tmp:
        Path(tmp).write_text(plan_markdown(plan))
    log.info("plan: %s of hidden states (%s free), %s per training process, extraction job %s of host RAM",
             size(plan["hidden_states_bytes"]), size(plan["free_disk_bytes"]), size(plan["training_gpu_memory_bytes"]),
             size(plan["extraction_host_ram_bytes"]))
    return plan
