"""The prompt suites the drafter is evaluated on in vLLM (rule eval_prompts).

A suite is a set of prompts the target answers while vLLM speculates. "heldout", the training
data's held-out split, is always one: each sample's tokens before its first generated one,
exactly what the target was asked. Every other suite is a file of eval.suites in data.prompts'
shape ({"id", "messages"} per line: an exported MT-Bench or GSM8K, docs/EVALUATION.md "Evaluation suites"),
rendered by the target's chat template as tokenize renders prompts (with their tools, where they
declare any: a suite of tool-using prompts). Either way a suite becomes
one JSONL of {"id", "prompt_token_ids", "where"} (where: the file and line it came from, for errors).
"""

import json
import logging

from eaglenest.data import generate
from eaglenest.data.prompts import Prompt, read_prompts
from eaglenest.data.samples import is_heldout, prompt_id_of, read_tokenized
from eaglenest.data.tokenizer import Tokenizer
from eaglenest.workflow.atomic import atomic_path
from eaglenest.workflow.config import HELDOUT_SUITE as HELDOUT
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.jsonl import read_objects

log = logging.getLogger(__name__)


def heldout_prompts(tokenized_path, heldout_fraction, max_prompts):
    """The held-out prompts, at most `max_prompts` (None: all), as suite entries named by prompt id:
    each once, from its first sample (its answers share the prompt's tokens)."""
    entries, seen = [], set()
    for line, sample in enumerate(read_tokenized(tokenized_path), 1):
        prompt_id = prompt_id_of(sample["id"])
        if max_prompts is not None and len(entries) == max_prompts:
            break
        if is_heldout(sample["id"], heldout_fraction) and prompt_id not in seen:
            seen.add(prompt_id)
            entries.append({"id": prompt_id, "prompt_token_ids": sample["input_ids"][: sample["loss_mask"].index(1)],
                            "where": f"{tokenized_path}:{line}"})
    if not entries:
        raise InputError(f"{tokenized_path}: no held-out samples (train.heldout_fraction {heldout_fraction})")
    return entries


def file_prompts(prompts_path, target_dir, max_prompts, *, trust_remote_code, chat_template_kwargs, think_start,
                 think_end, end_of_turn):
    """The first `max_prompts` prompts (None: all) of a suite file (errors name its file:line:field),
    rendered by the target's chat template with tokenize's settings, as generation renders them."""
    tokenizer = Tokenizer(target_dir, trust_remote_code=trust_remote_code, think_start=think_start,
                          think_end=think_end, end_of_turn=end_of_turn, chat_template_kwargs=chat_template_kwargs)
    return [{"id": p.id, "prompt_token_ids": tokenizer.prompt(p.messages, p.tools, where=p.where), "where": p.where}
            for p in read_prompts(prompts_path)[:max_prompts]]


def write_suite_prompts(out_path, suite, *, tokenized_path=None, prompts_path=None, target_dir=None,
                        heldout_fraction, max_prompts, tokenize):
    """Suite `suite`'s prompts into `out_path`: the held-out split of `tokenized_path` for HELDOUT,
    else `prompts_path` rendered by `target_dir`'s tokenizer (`tokenize`: trust_remote_code and the
    config's tokenize settings) -> their count."""
    if suite == HELDOUT:
        entries = heldout_prompts(tokenized_path, heldout_fraction, max_prompts)
    else:
        entries = file_prompts(prompts_path, target_dir, max_prompts, **tokenize)
    tokens = [len(e["prompt_token_ids"]) for e in entries]
    log.info("suite %s: %d prompts from %s, %d to %d tokens", suite, len(entries),
             tokenized_path if suite == HELDOUT else prompts_path, min(tokens), max(tokens))
    with atomic_path(out_path) as tmp, open(tmp, "w") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
    return len(entries)


def read_suites(paths, names):
    """{suite name: its entries} from eval_prompts' files, in `names`' order."""
    return {name: list(read_objects(path)) for name, path in zip(names, paths)}


def check_prompt_lengths(suites, max_model_len):
    """Refuse a prompt of vllm.max_model_len tokens or more (vLLM would), naming where it came
    from: generation's check (eaglenest.data.generate.check_prompt_lengths) on each suite."""
    for entries in suites.values():
        generate.check_prompt_lengths([Prompt(e["id"], None, None, e["where"]) for e in entries],
                                      [e["prompt_token_ids"] for e in entries], max_model_len)
