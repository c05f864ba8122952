"""Build the demo target: a tiny Llama that speaks Kimi's chat format, pre-trained on demo chats.

It stands in for Kimi-K2.5 so the whole workflow (generation in vLLM, hidden states, drafter
training, acceptance in vLLM) runs on a laptop. It keeps what matters for tokenization bugs:
Kimi's special tokens, each one id, placed after the ordinary vocabulary like Kimi's, and a chat
template that drops the reasoning of earlier assistant turns. Its geometry (head_dim 64, 8
layers) is the smallest that vLLM's CPU build and EAGLE-3 there accept (docs/VLLM.md, "vLLM on
CPU").

Only workflow plumbing (atomic writes, the JSONL reader) is imported from this package, so editing
the tokenization or any later stage never invalidates (or silently changes) the target.
"""

import json
import logging
import math
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eaglenest.workflow.atomic import atomic_dir
from eaglenest.workflow.jsonl import read_objects

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                  "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                  "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|pad|>"]

# docs/CONTRACTS.md, "Demo chat template". Earlier assistant turns lose their reasoning, as in
# Kimi's own template; `thinking` (default true) decides whether the generation prompt leaves
# the <think> block open. Tools as Kimi's template has them: the declarations in a `tool_declare`
# system turn, compact JSON; an assistant turn's calls in a section after its content, each
# `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>` (arguments as
# given when a string, else as JSON); a tool's result in a `tool` system turn headed by the id
# of the call it answers.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}<|im_system|>system<|im_middle|>{{ message.content }}<|im_end|>"
    "{%- elif message.role == 'user' -%}<|im_user|>user<|im_middle|>{{ message.content }}<|im_end|>"
    "{%- elif message.role == 'assistant' -%}"
    "<|im_assistant|>assistant<|im_middle|><think></think>{{ message.content }}"
    "{%- if message.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for call in message.tool_calls -%}"
    "<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>"
    "{%- if call.function.arguments is string -%}{{ call.function.arguments }}"
    "{%- else -%}{{ call.function.arguments | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}<|im_end|>"
    "{%- elif message.role == 'tool' -%}"
    "<|im_system|>tool<|im_middle|>## Return of {{ message.tool_call_id }}\n{{ message.content }}<|im_end|>"
    "{%- else -%}{{ raise_exception('unknown role: ' ~ message.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>"
    "{%- if thinking is defined and not thinking -%}</think>{%- endif -%}"
    "{%- endif -%}"
)


def tool_call_text(calls):
    """An assistant turn's tool calls as the template renders them and the model emits them."""
    return ("<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>{c['id']}<|tool_call_argument_begin|>{c['function']['arguments']}<|tool_call_end|>"
        for c in calls) + "<|tool_calls_section_end|>")


def _train_tokenizer(records, vocab_size, model_max_length):
    """Byte-level BPE (any unicode round-trips) on the texts of the chats, special tokens appended."""
    def texts():
        # What the template adds around them is special tokens, the role names and the tools' JSON.
        for rec in records:
            if rec.get("tools"):
                yield json.dumps(rec["tools"], separators=(",", ":"))
            for m in rec["messages"]:
                yield m["role"]
                yield m["content"]
                yield from (f"{c['id']} {c['function']['arguments']}" for c in m.get("tool_calls", []))
            yield from ("assistant", rec["reasoning_content"], rec["content"])
            yield from (f"{c['id']} {c['function']['arguments']}" for c in rec.get("tool_calls", []))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(), trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|pad|>")],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=model_max_length)


def _render(tokenizer, record):
    """The text exactly as the model sees it when it generates this answer in thinking mode (an
    answer that calls tools, its "tool_calls", ends with their section)."""
    if record["finish_reason"] != "stop":
        raise ValueError(f"{record['id']}: the corpus must hold finished conversations only")
    prompt = tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=False,
                                           add_generation_prompt=True, thinking=True)
    calls = tool_call_text(record["tool_calls"]) if record.get("tool_calls") else ""
    return prompt + record["reasoning_content"] + "</think>" + record["content"] + calls + "<|im_end|>"


def _pack(tokenizer, records, seq_len):
    """Concatenate the rendered chats and cut them into rows of seq_len tokens (the tail is dropped)."""
    ids = tokenizer([_render(tokenizer, r) for r in records], add_special_tokens=False)["input_ids"]
    stream = torch.tensor([t for doc in ids for t in doc], dtype=torch.long)
    rows = len(stream) // seq_len
    if rows == 0:
        raise ValueError(f"{len(records)} chats make less than one sequence of {seq_len} tokens")
    return stream[: rows * seq_len].view(rows, seq_len)


@torch.no_grad()
def _mean_loss(model, rows, batch_size):
    model.eval()
    total = sum(model(input_ids=b, labels=b).loss.item() * len(b) for b in rows.split(batch_size))
    model.train()
    return total / len(rows)


def _train(model, rows, *, seed, batch_size, steps, lr):
    """AdamW with linear warmup and cosine decay, rows drawn epoch by epoch in a seeded order.

    Returns the mean loss of the last tenth of the steps (one step's loss is too noisy to report).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 10)

    def lr_factor(step):  # linear warmup, then cosine down to a tenth of lr
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    log_every = max(1, steps // 10)
    losses = []
    start = time.time()
    for step in range(steps):
        if len(order) < batch_size:  # a new epoch in a new order; the few rows left over are skipped
            order = torch.randperm(len(rows), generator=generator)
        batch, order = rows[order[:batch_size]], order[batch_size:]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            rate = (step + 1) / (time.time() - start)
            log.info("step %d/%d  loss %.3f  %.2f steps/s  ETA %.0fs",
                     step + 1, steps, losses[-1], rate, (steps - step - 1) / rate)
    return sum(losses[-log_every:]) / log_every


def build_demo_target(corpus_path, out_dir, *, seed=0, vocab_size=512, num_layers=8, hidden_size=128,
                      intermediate_size=384, num_heads=2, num_kv_heads=1, head_dim=64, seq_len=256,
                      batch_size=8, steps=240, lr=5e-3):
    """Train the tokenizer and the model on `corpus_path` (canonical records) and write them to `out_dir`.

    Deterministic: the same seed gives bit-identical weights on the same machine. `out_dir` appears
    only when the build succeeded. Returns the metadata also written to demo_target.json.
    """
    start = time.time()
    records = list(read_objects(corpus_path))
    heldout = max(1, len(records) // 20)
    train_records, heldout_records = records[:-heldout], records[-heldout:]
    max_positions = max(512, seq_len)

    with atomic_dir(out_dir) as tmp:
        tokenizer = _train_tokenizer(train_records, vocab_size, max_positions)
        tokenizer.save_pretrained(tmp)
        train_rows = _pack(tokenizer, train_records, seq_len)
        heldout_rows = _pack(tokenizer, heldout_records, seq_len)
        log.info("tokenizer: %d ids; %d train rows, %d held-out rows of %d tokens",
                 len(tokenizer), len(train_rows), len(heldout_rows), seq_len)

        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            head_dim=head_dim, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        model = LlamaForCausalLM(config)
        heldout_init = _mean_loss(model, heldout_rows, batch_size)

        train_loss = _train(model, train_rows, seed=seed, batch_size=batch_size, steps=steps, lr=lr)
        meta = {
            "seed": seed, "steps": steps, "vocab_size": len(tokenizer), "num_layers": num_layers,
            "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "seq_len": seq_len,
            "batch_size": batch_size, "lr": lr, "train_tokens": train_rows.numel(),
            "heldout_tokens": heldout_rows.numel(),
            "train_loss": train_loss,
            "heldout_loss_init": heldout_init,
            "heldout_loss": _mean_loss(model, heldout_rows, batch_size),
        }
        model.save_pretrained(tmp)
        (tmp / "demo_target.json").write_text(json.dumps(meta, indent=2) + "\n")
    log.info("demo target in %s after %.0fs: train loss %.3f, held-out loss %.3f (%.3f at init)",
             out_dir, time.time() - start, train_loss, meta["heldout_loss"], heldout_init)
    return meta
