"""The drafter in real vLLM: acceptance and speed-up (the vllm_runs stage).

The target answers the held-out prompts greedily in vLLM, once alone and once with the drafter.
Speculation must not change the text. vLLM's own counters give the online acceptance, which the
evaluate_vllm stage holds against the offline evaluator's on the same continuations
(eaglenest.evaluate.agreement), from the target's states of them (eaglenest.evaluate.agreement_states).
"""

import json
import logging

from eaglenest.data.samples import is_heldout, read_tokenized
from eaglenest.data.tokenizer import load_tokenizer, special_token_id
from eaglenest.engine import generate, vllm_cpu
from eaglenest.workflow.atomic import atomic_path, write_json
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)


def heldout_prompts(tokenized_path, heldout_fraction, max_prompts):
    """(ids, prompt token ids) of the held-out samples: each sample's tokens before its first
    generated one, exactly what the target was asked."""
    ids, prompts = [], []
    for sample in read_tokenized(tokenized_path):
        if is_heldout(sample["id"], heldout_fraction) and len(ids) < max_prompts:
            ids.append(sample["id"])
            prompts.append(sample["input_ids"][: sample["loss_mask"].index(1)])
    if not ids:
        raise InputError(f"{tokenized_path}: no held-out samples (train.heldout_fraction {heldout_fraction})")
    return ids, prompts


def greedy_divergence(ids, plain, spec):
    """How speculation changed greedy text: {"divergent_share": share of prompts whose tokens
    differ, "first_divergence": the first such prompt's id and the generated token where it
    differs, or None}."""
    changed = [i for i, (a, b) in enumerate(zip(plain, spec)) if a != b]
    first = None
    if changed:
        a, b = plain[changed[0]], spec[changed[0]]
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first = {"id": ids[changed[0]], "generated_token": at}
    return {"divergent_share": len(changed) / len(plain), "first_divergence": first}


def check_greedy_identity(divergence, *, exact, max_divergent_share):
    """Speculation must not change greedy text. Where the engine is bit-exact (vLLM's CPU build
    in float32) one changed prompt is a fault; elsewhere (bf16 on GPUs, whose verification
    batches are not bit-identical to plain decoding) text may drift late, so only a share of
    changed prompts above `max_divergent_share` is (docs/PITFALLS.md, "Reproducible bytes and
    GPU numerics")."""
    share, first = divergence["divergent_share"], divergence["first_divergence"]
    limit = 0.0 if exact else max_divergent_share
    if share > limit:
        rule = "bit-exact engine: none may" if exact else f"eval.max_divergent_share {max_divergent_share}"
        raise InputError(f"speculation changed the greedy text of {share:.1%} of the prompts ({rule}), "
                         f"first {first['id']!r} at generated token {first['generated_token']}")


def vllm_runs(tokenized_path, target_dir, drafter_dir, outputs_path, runs_path, *, heldout_fraction,
              num_speculative_tokens, max_tokens, max_prompts, concurrency, max_divergent_share, vllm,
              trust_remote_code, end_of_turn):
    """Run the target in vLLM without and with the drafter on the held-out prompts; write the
    greedy continuations (JSONL) and vllm_runs.json (vLLM's counters, speeds, divergence); fail
    when speculation changed the text. `concurrency` requests run at once: speculation pays off
    when decoding is latency-bound. Continuations end at the `end_of_turn` token, as the target's
    turns do when it is served."""
    K = num_speculative_tokens
    ids, prompts = heldout_prompts(tokenized_path, heldout_fraction, max_prompts)
    log.info("%d held-out prompts, %d tokens each at most, K=%d", len(prompts), max_tokens, K)
    engine = {"trust_remote_code": trust_remote_code, "max_tokens": max_tokens, "max_num_seqs": concurrency,
              "stop_token_ids": [special_token_id(load_tokenizer(target_dir, trust_remote_code=trust_remote_code),
                                                  end_of_turn)]}
    plain = generate(target_dir, prompts, vllm, **engine, progress="without speculation")
    log.info("without speculation: %.0f tok/s", plain["tokens_per_s"])
    spec = generate(target_dir, prompts, vllm, **engine, drafter_dir=drafter_dir, num_speculative_tokens=K,
                    progress="with the drafter")
    log.info("with the drafter: %.0f tok/s, counters %s", spec["tokens_per_s"], spec["counters"])
    with atomic_path(outputs_path) as tmp, open(tmp, "w") as f:
        for sample_id, prompt, tokens in zip(ids, prompts, plain["token_ids"]):
            f.write(json.dumps({"id": sample_id, "prompt_token_ids": prompt, "token_ids": tokens}) + "\n")
    divergence = greedy_divergence(ids, plain["token_ids"], spec["token_ids"])
    exact = vllm_cpu() and vllm["dtype"] == "float32"
    log.info("greedy text changed by speculation in %.1f%% of the prompts (first: %s; %s)",
             100 * divergence["divergent_share"], divergence["first_divergence"],
             "bit-exact engine" if exact else f"at most {max_divergent_share:.1%} allowed")
    check_greedy_identity(divergence, exact=exact, max_divergent_share=max_divergent_share)
    runs = {
        "vllm_version": plain["vllm_version"],
        "num_speculative_tokens": K,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "generated_tokens": plain["generated_tokens"],
        "counters": spec["counters"],  # vLLM's spec-decode counters (eaglenest.engine.SPEC_COUNTERS)
        "tokens_per_s_without_speculation": plain["tokens_per_s"],
        "tokens_per_s_with_speculation": spec["tokens_per_s"],
        "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
        "greedy_text_unchanged": divergence["divergent_share"] == 0,
        **divergence,
        "greedy_identity_exact": exact,
        "max_divergent_share": max_divergent_share,
    }
    log.info("vLLM runs: %s", json.dumps(runs))
    write_json(runs_path, runs)
    return runs

