"""The drafter in real vLLM: acceptance and speed-up, and proof that vLLM runs the drafter we trained.

The target answers the held-out prompts greedily in vLLM, once alone and once with the drafter.
Speculation must not change the text. vLLM's own counters give the online acceptance, which must
agree with the offline evaluator's on the same continuations (eaglenest.evaluate.agreement).
"""

import json
import logging

from eaglenest.data.samples import is_heldout, read_tokenized
from eaglenest.data.tokenizer import load_tokenizer, special_token_id
from eaglenest.engine import generate
from eaglenest.evaluate.agreement import verify_agreement
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


def evaluate_vllm(tokenized_path, target_dir, drafter_dir, trained_config_path, manifest_path, d2t_path, t2d_path,
                  metrics_path, outputs_path, *, heldout_fraction, num_speculative_tokens, max_tokens,
                  max_prompts, concurrency, agreement_tolerance, vllm, trust_remote_code, end_of_turn):
    """Run the target in vLLM without and with the drafter on the held-out prompts; write the
    greedy continuations (JSONL) and vllm_metrics.json; fail when speculation changed the text
    or when vLLM's acceptance disagrees with the offline evaluator on that text.
    `concurrency` requests run at once: speculation pays off when decoding is latency-bound.
    Continuations end at the `end_of_turn` token, as the target's turns do when it is served."""
    K = num_speculative_tokens
    ids, prompts = heldout_prompts(tokenized_path, heldout_fraction, max_prompts)
    log.info("%d held-out prompts, %d tokens each at most, K=%d", len(prompts), max_tokens, K)
    engine = {"trust_remote_code": trust_remote_code, "max_tokens": max_tokens, "max_num_seqs": concurrency,
              "stop_token_ids": [special_token_id(load_tokenizer(target_dir, trust_remote_code=trust_remote_code),
                                                  end_of_turn)]}
    plain = generate(target_dir, prompts, vllm, **engine)
    log.info("without speculation: %.0f tok/s", plain["tokens_per_s"])
    spec = generate(target_dir, prompts, vllm, **engine, drafter_dir=drafter_dir, num_speculative_tokens=K)
    log.info("with the drafter: %.0f tok/s, counters %s", spec["tokens_per_s"], spec["counters"])
    with atomic_path(outputs_path) as tmp, open(tmp, "w") as f:
        for sample_id, prompt, tokens in zip(ids, prompts, plain["token_ids"]):
            f.write(json.dumps({"id": sample_id, "prompt_token_ids": prompt, "token_ids": tokens}) + "\n")
    changed = [i for i, (a, b) in enumerate(zip(plain["token_ids"], spec["token_ids"])) if a != b]
    if changed:
        a, b = plain["token_ids"][changed[0]], spec["token_ids"][changed[0]]
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise InputError(f"speculation changed the greedy text of {len(changed)}/{len(prompts)} prompts, "
                         f"first {ids[changed[0]]!r} at generated token {at}")
    online, offline, gap = verify_agreement(
        target_dir, drafter_dir, trained_config_path, manifest_path, d2t_path, t2d_path, prompts,
        plain["token_ids"], spec["counters"], num_speculative_tokens=K, agreement_tolerance=agreement_tolerance,
        trust_remote_code=trust_remote_code)
    metrics = {
        "vllm_version": plain["vllm_version"],
        "num_speculative_tokens": K,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "generated_tokens": plain["generated_tokens"],
        **online,
        "tokens_per_s_without_speculation": plain["tokens_per_s"],
        "tokens_per_s_with_speculation": spec["tokens_per_s"],
        "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
        "greedy_text_unchanged": True,
        "offline_on_vllm_text": offline,
        "max_disagreement": gap,
        "agreement_tolerance": agreement_tolerance,
    }
    log.info("vLLM metrics: %s", json.dumps(metrics))
    write_json(metrics_path, metrics)
    return metrics
