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

Tool calls: a turn that calls tools is kept from the ids the target emitted (reasoning before and
between calls, the section, <|im_end|> after it), never rebuilt from text. Where the target's
tool-call tokens are named (tokenize.tool_call_tokens), the report counts the samples whose
generated tokens hold a tool-call section and those with a call whose arguments are not valid
JSON: reported, not fixed (the drafter learns what the target emits, broken JSON included).
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


def tool_call_arguments(generated, tool_calls):
    """The id runs of each call's arguments in `generated` (from argument_begin to call_end, or to
    the end of a call cut short); `tool_calls`: Tokenizer.tool_calls."""
    starts = [i + 1 for i, t in enumerate(generated) if t == tool_calls["argument_begin"]]
    ends = [next((j for j in range(i, len(generated)) if generated[j] == tool_calls["call_end"]), len(generated))
            for i in starts]
    return [generated[i:j] for i, j in zip(starts, ends)]


def invalid_arguments(generated, tokenizer):
    """How many calls in `generated` have arguments that are not valid JSON."""
    bad = 0
    for run in tool_call_arguments(generated, tokenizer.tool_calls):
        try:
            json.loads(tokenizer.hf.decode(run))
        except json.JSONDecodeError:
            bad += 1
    return bad


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
        prompt = tokenizer.prompt(record.messages, record.tools, where=record.where)
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
    tool_call_tokens=None,
):
    """raw_responses.jsonl → tokenized_data.jsonl + tokenize_report.json, both atomic.
    trust_remote_code: run the tokenizer's own code (config target.trust_remote_code);
    tool_call_tokens: the target's (config tokenize.tool_call_tokens; None: not counted)."""
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
        tool_call_tokens=tool_call_tokens,
    )
    rejected, stats = Counter(), Counter()
    with atomic_path(out_path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for i, record in enumerate(records, 1):
            input_ids, loss_mask = tokenize_record(record, tokenizer)
            if tokenizer.tool_calls:  # counted on what the target emitted, before any truncation
                generated = [t for t, m in zip(input_ids, loss_mask) if m]
                stats["tool_call_turns"] += tokenizer.tool_calls["section_begin"] in generated
                stats["tool_call_arguments_not_json"] += invalid_arguments(generated, tokenizer) > 0
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
    if tokenizer.tool_calls:
        report["tool_call_turns"] = stats["tool_call_turns"]  # samples whose generated tokens call a tool
        report["tool_call_arguments_not_json"] = stats["tool_call_arguments_not_json"]  # samples, not calls
    write_json(report_path, report)
    log.info("tokenize: %s", report)
    return report
