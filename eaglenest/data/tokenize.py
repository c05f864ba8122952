"""Faithful tokenization: the token stream the target really saw and emitted (docs/TOKENIZATION.md,
"Token stream").

input_ids = rendered prompt (chat template, add_generation_prompt=True, the template kwargs used
at generation time) + the generated tokens; loss_mask = 1 exactly on the generated tokens.

Generated tokens, when the record has no token ids (thinking mode: the prompt ends with <think>):
    think block closed        REASONING </think> CONTENT [<|im_end|>]
    think block still open    REASONING [<|im_end|>]          (stopped or cut while thinking)
with <|im_end|> only when finish_reason is "stop". The block is closed when the record says so
(reasoning_closed) or, when it does not, when there is content: a </think> the model may not have
emitted is never added. Non-thinking prompts (not ending with <think>) take CONTENT [<|im_end|>]
and no reasoning; so does every prompt of a target without a reasoning block (think_start and
think_end null), whose records must carry no reasoning fields at all. Record token ids, when
present, are used verbatim. Text from users and from the model is encoded with special-token
parsing OFF, so a literal "<think>" typed by a user stays plain text, whatever the tokenizer's
encode defaults to (Tokenizer.text).
"""

import json
import logging
from collections import Counter

from eaglenest.data.records import read_records
from eaglenest.data.tokenizer import Tokenizer
from eaglenest.workflow.atomic import atomic_path, write_json
from eaglenest.workflow.errors import InputError

log = logging.getLogger(__name__)

OVERLONG_POLICIES = ("truncate", "drop", "error")


def tokenize_record(record, tokenizer):
    """Record → (input_ids, loss_mask)."""
    tokenizer.check_no_reasoning(record)
    if record.prompt_token_ids is not None:
        prompt, generated = record.prompt_token_ids, record.completion_token_ids
        vocab = len(tokenizer.hf)
        bad = [t for t in prompt + generated if t >= vocab]
        if bad:
            raise InputError(f"{record.where}: field 'prompt_token_ids'/'completion_token_ids': id {bad[0]} outside the vocabulary ({vocab})")
    else:
        prompt = tokenizer.prompt(record.messages)
        generated = tokenizer.generated(record, thinking=tokenizer.thinking(prompt))
    return prompt + generated, [0] * len(prompt) + [1] * len(generated)


def tokenize_file(
    raw_path,
    target_dir,
    out_path,
    report_path,
    *,
    trust_remote_code,
    max_seq_len,
    overlong,
    chat_template_kwargs,
    think_start,
    think_end,
    end_of_turn,
):
    """raw_responses.jsonl → tokenized_data.jsonl + tokenize_report.json, both atomic.
    trust_remote_code: run the tokenizer's own code (config target.trust_remote_code)."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    records = read_records(raw_path)
    tokenizer = Tokenizer(
        target_dir,
        trust_remote_code=trust_remote_code,
        think_start=think_start,
        think_end=think_end,
        end_of_turn=end_of_turn,
        chat_template_kwargs=chat_template_kwargs,
    )
    rejected, stats = Counter(), Counter()
    with atomic_path(out_path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for i, record in enumerate(records, 1):
            input_ids, loss_mask = tokenize_record(record, tokenizer)
            if len(input_ids) > max_seq_len:
                if overlong == "error":
                    raise InputError(
                        f"{record.where}: sample {record.id!r}: {len(input_ids)} tokens "
                        f"> max_seq_len {max_seq_len} (set tokenize.overlong to truncate or drop)"
                    )
                if overlong == "drop":
                    rejected["too_long"] += 1
                    continue
                input_ids, loss_mask = input_ids[:max_seq_len], loss_mask[:max_seq_len]
                stats["truncated"] += 1
            if not any(loss_mask):
                rejected["no_generated_tokens"] += 1
                continue
            out.write(json.dumps({"id": record.id, "input_ids": input_ids, "loss_mask": loss_mask}) + "\n")
            stats["samples_out"] += 1
            stats["tokens"] += len(input_ids)
            stats["generated_tokens"] += sum(loss_mask)
            if i % 1000 == 0:
                log.info("tokenized %d/%d records", i, len(records))
    report = {
        "samples_in": len(records),
        "samples_out": stats["samples_out"],
        "tokens": stats["tokens"],
        "generated_tokens": stats["generated_tokens"],
        "truncated": stats["truncated"],
        "rejected": dict(rejected),
    }
    write_json(report_path, report)
    log.info("tokenize: %s", report)
    return report
