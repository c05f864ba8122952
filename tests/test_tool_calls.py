"""Tool calls through the token stream (issue 56) on the Kimi-style tokenizer (tests/kimi_tokenizer.py):
Kimi's tool-call tokens each one id, tool prompts rendered as Kimi's template renders them, a
generated turn that calls a tool kept with its exact ids, and the tokenize report's counts."""

import json
import math
import shutil

import pytest
import torch

from eaglenest.data.generate import response_record, write_records
from eaglenest.data.records import read_records
from eaglenest.data.tokenize import tokenize_file, tokenize_record
from eaglenest.data.tokenizer import Tokenizer
from eaglenest.demo.kimi_tokenizer import NAMED, TOOL_CALL_TOKENS
from eaglenest.evaluate.acceptance import (acceptance, draft_anchors, drafts_in_span, served_anchors, served_positions,
                                          span_counters, span_mask)
from eaglenest.evaluate.expected import sample_counts
from eaglenest.evaluate.offline import served_figures, tool_call_split
from eaglenest.evaluate.summary import tool_call_table
from eaglenest.report.evaluate import heldout_table, tool_call_spans_table
from eaglenest.workflow.errors import InputError

from kimi_tokenizer import kimi_tokenizer_dir  # noqa: F401 (a fixture)
from test_kimi_tokenizer import spans
from test_prompt_sources import TOOLS, tool_prompts

SETTINGS = dict(trust_remote_code=True, chat_template_kwargs={"thinking": True}, think_start="<think>",
                think_end="</think>", end_of_turn="<|im_end|>")
CALL_ARGUMENTS = '{"expression": "12 * 7"}'


@pytest.fixture(scope="module")
def kimi(kimi_tokenizer_dir):  # noqa: F811
    return Tokenizer(kimi_tokenizer_dir, tool_call_tokens=TOOL_CALL_TOKENS, **SETTINGS)


def test_kimis_tool_call_tokens_are_one_id_each_at_kimis_offsets_and_round_trip(kimi):
    base = kimi.hf.model.n_vocab - 256
    offsets = {name: offset for offset, name in NAMED.items()}
    for name, token in TOOL_CALL_TOKENS.items():
        token_id = kimi.tool_calls[name]
        assert token_id == base + offsets[token] and base + 11 <= token_id <= base + 15  # 163,595 to 163,599 in Kimi
        assert kimi.template(token) == [token_id] and kimi.hf.decode([token_id]) == token
        assert token_id not in kimi.text(token)  # typed, it stays text
        assert kimi.hf.decode(kimi.text(token)) == token


def test_a_tool_prompt_renders_as_the_template_does_declarations_calls_and_results(kimi):
    prompt = tool_prompts("t1", "call_1", CALL_ARGUMENTS)[1]
    ids = kimi.prompt(prompt["messages"], prompt["tools"])
    assert spans(kimi, ids) == [
        "<|im_system|>", "tool_declare", "<|im_middle|>", json.dumps(TOOLS, separators=(",", ":")), "<|im_end|>",
        "<|im_user|>", "user", "<|im_middle|>", "What is 12 * 7?", "<|im_end|>",
        "<|im_assistant|>", "assistant", "<|im_middle|>", "<think>", "</think>",
        "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "call_1", "<|tool_call_argument_begin|>",
        CALL_ARGUMENTS, "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>",
        "<|im_system|>", "tool", "<|im_middle|>", "## Return of call_1\n84", "<|im_end|>",
        "<|im_assistant|>", "assistant", "<|im_middle|>", "<think>"]
    rendered = kimi.hf.apply_chat_template(prompt["messages"], tools=prompt["tools"], tokenize=False,
                                           add_generation_prompt=True, thinking=True)
    assert ids == kimi.hf.encode(rendered)  # the template's own text, nothing typed in it
    typed = [*prompt["messages"][:2], prompt["messages"][2] | {"content": "<|tool_call_end|> <think>"}]
    result = spans(kimi, kimi.prompt(typed, prompt["tools"]))
    assert result[result.index("tool") + 2] == "## Return of call_1\n<|tool_call_end|> <think>"  # a result is text


def emitted(kimi, *pieces):
    """Completion ids from pieces: a token name of Kimi's (a special) or text (plain)."""
    specials = {**{t: kimi.template(t)[0] for t in TOOL_CALL_TOKENS.values()},
                "</think>": kimi.think_end, "<|im_end|>": kimi.end_of_turn}
    return [i for p in pieces for i in ([specials[p]] if p in specials else kimi.text(p))]


def test_a_generated_turn_that_calls_a_tool_keeps_its_ids_and_the_report_counts_calls_and_broken_json(
        kimi, kimi_tokenizer_dir, tmp_path):  # noqa: F811
    """Reasoning, a call, reasoning between calls, a second call, <|im_end|>: kept as emitted; a
    call cut by max_tokens has arguments that are no JSON, counted, not fixed."""
    ask, answered = tool_prompts("t1", "call_1", CALL_ARGUMENTS)
    call = ["<|tool_call_begin|>", "functions.calculator:0", "<|tool_call_argument_begin|>", CALL_ARGUMENTS,
            "<|tool_call_end|>"]
    two_calls = emitted(kimi, "I need the calculator.", "</think>", "<|tool_calls_section_begin|>", *call,
                        "<|tool_calls_section_end|>", "<|im_end|>")
    cut = emitted(kimi, "Let me call it.", "</think>", "<|tool_calls_section_begin|>", *call[:3], '{"expression": "12')
    words = emitted(kimi, "The tool says 84.", "</think>", "12 * 7 = 84.", "<|im_end|>")
    records = []
    for answer_id, prompt, completion, finish in (("a", ask, two_calls, "stop"), ("b", ask, cut, "length"),
                                                  ("c", answered, words, "stop")):
        prompt_ids = kimi.prompt(prompt["messages"], prompt["tools"])
        records.append(response_record(answer_id, prompt["messages"], prompt_ids, completion, finish, kimi,
                                       temperature=0, tools=prompt["tools"]))
    raw = tmp_path / "raw.jsonl"
    write_records(raw, records)
    report = tokenize_file(raw, kimi_tokenizer_dir, tmp_path / "tok.jsonl", tmp_path / "report.json",
                           max_seq_len=4096, overlong="error", tool_call_tokens=TOOL_CALL_TOKENS, **SETTINGS)
    samples = [json.loads(line) for line in (tmp_path / "tok.jsonl").open()]
    for sample, record in zip(samples, records):
        assert sample["input_ids"] == record["prompt_token_ids"] + record["completion_token_ids"]
        assert sample["loss_mask"] == [0] * len(record["prompt_token_ids"]) + [1] * len(record["completion_token_ids"])
    assert (report["tool_call_turns"], report["tool_call_arguments_not_json"]) == (2, 1)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    # the record keeps the prompt's tools: rebuilt from its messages, its prompt is the same ids
    rebuilt = read_records(raw)[2]
    assert rebuilt.tools == TOOLS and kimi.prompt(rebuilt.messages, rebuilt.tools) == records[2]["prompt_token_ids"]


def test_a_tool_call_is_never_rebuilt_from_text(kimi, tmp_path):
    """Without token ids a tool-call turn is refused: in the text, in an OpenAI-shaped response."""
    ask = tool_prompts("t1", "call_1", CALL_ARGUMENTS)[0]
    text = {"id": "x", **ask, "reasoning_content": "", "content": "<|tool_calls_section_begin|>...",
            "finish_reason": "stop"}
    openai = {"id": "y", **ask, "response": {"id": "y", "choices": [{"finish_reason": "tool_calls", "message": {
        "content": None, "tool_calls": [{"id": "functions.calculator:0", "type": "function",
                                         "function": {"name": "calculator", "arguments": CALL_ARGUMENTS}}]}}]}}
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(text) + "\n")
    with pytest.raises(InputError, match=r"raw\.jsonl:1: field 'content': a tool call .* kept only from the token ids"):
        tokenize_record(read_records(raw)[0], kimi)
    raw.write_text(json.dumps(openai) + "\n")
    with pytest.raises(InputError, match=r"raw\.jsonl:1: field 'response\.choices\[0\]\.finish_reason': a turn with "
                                         r"tool calls is kept only from its token ids"):
        read_records(raw)
    ids = {"prompt_token_ids": [1, 2]}
    openai["response"] |= ids
    openai["response"]["choices"][0]["token_ids"] = [3, 4]
    raw.write_text(json.dumps(openai) + "\n")
    assert read_records(raw)[0].finish_reason == "stop"  # vLLM's "tool_calls": the turn stopped


def test_a_template_that_cannot_render_tools_is_one_error_naming_the_prompt(kimi_tokenizer_dir, tmp_path):  # noqa: F811
    plain = shutil.copytree(kimi_tokenizer_dir, tmp_path / "plain")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{%- for m in messages -%}{%- if m.role == 'tool' -%}{{ raise_exception('unknown role: "
                               "tool') }}{%- endif -%}<|im_user|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
                               "{%- endfor -%}<|im_assistant|>assistant<|im_middle|><think>")
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(plain, **SETTINGS)
    ask, answered = tool_prompts("t1", "call_1", CALL_ARGUMENTS)
    with pytest.raises(InputError, match=r"^prompts\.jsonl:1: field 'tools': the target's chat template does not "
                                         r"render tools"):
        tokenizer.prompt(ask["messages"], ask["tools"], where="prompts.jsonl:1")
    with pytest.raises(InputError, match=r"^prompts\.jsonl:2: field 'messages': the target's chat template cannot "
                                         r"render this prompt: unknown role: tool$"):
        tokenizer.prompt(answered["messages"], None, where="prompts.jsonl:2")


BEGIN, END = 90, 91  # a tool-call section's first and last token


def test_a_tool_call_span_runs_from_the_section_begin_through_its_end():
    ids = torch.tensor([[5, BEGIN, 1, 2, END, 7, BEGIN, 3],  # the second section cut by max_tokens: to the end
                        [END, 1, BEGIN, 2, END, 3, 4, 5]])  # an end before any begin opens nothing
    assert span_mask(ids, BEGIN, END).int().tolist() == [[0, 1, 1, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0]]
    # a draft at anchor t starts at x_{t+2}: it is the span's when that token is
    assert drafts_in_span(ids, BEGIN, END).int().tolist() == [[1, 1, 1, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert drafts_in_span(ids[0], BEGIN, END).tolist() == drafts_in_span(ids, BEGIN, END)[0].tolist()  # one sample


def test_the_drafts_in_tool_call_spans_and_the_rest_split_vllms_drafts_and_their_counts():
    """What the summary puts side by side adds up to what vLLM counts: each served draft is in
    one part, by where it starts, and drafting goes on as vLLM's (served positions on all anchors)."""
    generator = torch.Generator().manual_seed(0)
    T, K = 64, 3
    ids = torch.randint(0, 80, (T,), generator=generator)
    ids[[10, 40]], ids[[25, 52]] = BEGIN, END
    anchors = torch.ones(T, dtype=torch.bool)
    anchors[-2:] = False
    matched = (torch.rand(K, T, generator=generator) < 0.7).cumprod(0).bool()
    inside = drafts_in_span(ids, BEGIN, END)
    whole, spans, rest = (sample_counts(anchors, matched, None, K, keep) for keep in (None, inside, ~inside))
    assert spans[0] > 0 and rest[0] > 0 and spans[0] + rest[0] == whole[0]
    assert [a + b for a, b in zip(spans[1], rest[1])] == whole[1]
    lengths = matched.sum(0).tolist()
    assert acceptance(served_anchors(anchors.tolist(), lengths, inside.tolist()), K)["num_accepted_tokens_per_position"] \
        == spans[1]  # offline.py's count of the same drafts


def test_vllms_own_steps_split_at_tool_call_spans_as_the_offline_replay_splits_its_drafts():
    """span_counters walks vLLM's per-step accepted counts over prompt + output; on the same text
    and the same accepted lengths it splits the drafts exactly as the offline side does (a
    section in the prompt, one closed in the output, one cut by the end of the output)."""
    generator = torch.Generator().manual_seed(1)
    prompt, K = [7, BEGIN, 8, END, 9], 3
    output = torch.randint(0, 80, (40,), generator=generator)
    output[[6, 30]], output[[17]] = BEGIN, END
    ids = torch.tensor(prompt + output.tolist())
    generated = torch.arange(len(ids)) >= len(prompt)
    anchors = draft_anchors(generated[None])[0].tolist()
    lengths = torch.randint(0, K + 1, (len(ids),), generator=generator).tolist()
    steps = [lengths[t] for t in served_positions(anchors, lengths)]  # what vLLM's per-step counts would read
    inside = drafts_in_span(ids, BEGIN, END).tolist()
    # every step counted (ends: no text cut here; the cut at a text's end is test_mla_vllm's)
    split = span_counters([prompt], [output.tolist()], [steps], [[K] * len(steps)], [math.inf], (BEGIN, END), K)
    for name, keep in (("tool_call_spans", inside), ("outside_tool_call_spans", [not i for i in inside])):
        offline = acceptance(served_anchors(anchors, lengths, keep), K)
        assert split[name]["num_drafts"] == offline["num_drafts"] > 0
        assert split[name]["num_accepted_tokens_per_position"] == offline["num_accepted_tokens_per_position"]
        assert split[name]["num_draft_tokens"] == K * offline["num_drafts"]


def test_the_summary_shows_acceptance_on_tool_call_spans_beside_the_rest():
    def fields(rates, drafts):
        return {"acceptance_rate_per_position": rates, "num_drafts": drafts}

    run = {"suite": "tools", "temperature": 0.0, "concurrency": 4, "draft_sample_method": "greedy",
           "num_speculative_tokens": 3, **fields([0.9, 0.7, 0.5], 100),
           "tool_call_spans": fields([0.96, 0.9, 0.85], 41), "outside_tool_call_spans": fields([0.86, 0.57, 0.27], 59),
           "offline": {**fields([0.9, 0.7, 0.5], 100), "tool_call_spans": fields([0.95, 0.9, 0.85], 40),
                       "outside_tool_call_spans": fields([0.87, 0.57, 0.27], 60)}}
    plain = {"suite": "chat", "offline": fields([0.8, 0.6, 0.4], 90)}  # not split: not shown
    lines = tool_call_table({"runs": [plain, run]})
    assert lines[5] == ("| tools | 0 | 4 | greedy K=3 | 0.96 / 0.90 / 0.85 | 0.95 / 0.90 / 0.85 | 41, 40 "
                        "| 0.86 / 0.57 / 0.27 | 0.87 / 0.57 / 0.27 | 59, 60 |")
    assert len(lines) == 8 and tool_call_table({"runs": [plain]}) == []


def test_the_report_shows_the_same_split():
    def fields(rates, drafts):
        return {"acceptance_rate_per_position": rates, "num_drafts": drafts, "num_accepted_tokens": 1,
                "mean_acceptance_length": 1 + sum(rates)}

    run = {"suite": "tools", "temperature": 0.0, "concurrency": 4, "draft_sample_method": "greedy",
           "num_speculative_tokens": 3, **fields([0.9, 0.7, 0.5], 100),
           "tool_call_spans": fields([0.96, 0.9, 0.85], 41), "outside_tool_call_spans": fields([0.86, 0.57, 0.27], 59),
           "offline": {**fields([0.9, 0.7, 0.5], 100), "tool_call_spans": fields([0.95, 0.9, 0.85], 40),
                       "outside_tool_call_spans": fields([0.87, 0.57, 0.27], 60)}}
    online = {"runs": [run], "draft_sample_methods": ["greedy"], "suites": {"tools": 24}}
    row = tool_call_spans_table(online).iloc[0]
    assert (row["tool-call spans, vLLM"], row["tool-call spans"], row["drafts there"], row["mean acceptance length there"],
            row["elsewhere, vLLM"]) == ("0.960\u00a0/\u00a00.900\u00a0/\u00a00.850",
                                        "0.950\u00a0/\u00a00.900\u00a0/\u00a00.850", "40", "3.70",
                                        "0.860\u00a0/\u00a00.570\u00a0/\u00a00.270")
    offline = {"served": {**fields([0.9, 0.7, 0.5], 100), "ceiling_per_position": [1, 1, 1],
                          "tool_call_spans": fields([0.95, 0.9, 0.85], 40),
                          "outside_tool_call_spans": fields([0.87, 0.57, 0.27], 60)}, **fields([0.9, 0.7, 0.5], 300)}
    assert list(heldout_table(offline)["drafts from"])[1:3] == ["served, drafts starting in a tool call",
                                                                 "served, drafts starting elsewhere"]


def test_offline_splits_a_batch_of_served_drafts_at_tool_call_spans():
    """evaluate_offline's split of a batch: every served draft in one part, by where it starts."""
    ids = torch.tensor([[5, 6, BEGIN, 1, 2, END, 7, 8, 9, 10], [1, BEGIN, 2, 3, 4, 5, END, 6, 7, 8]])
    anchors = [[True] * 8 + [False] * 2] * 2
    lengths = [[1, 0, 2, 0, 1, 3, 0, 0, 0, 0], [0, 2, 1, 0, 0, 1, 2, 0, 0, 0]]
    spans, rest = tool_call_split((BEGIN, END), ids, anchors, lengths)
    whole = [n for a, l in zip(anchors, lengths) for n in served_anchors(a, l)]
    assert sorted(spans + rest) == sorted(whole) and spans and rest
    assert tool_call_split(None, ids, anchors, lengths) == ([], [])
    figures = served_figures(whole, whole, 3, (spans, rest))
    assert figures["tool_call_spans"]["num_drafts"] + figures["outside_tool_call_spans"]["num_drafts"] == len(whole)
    assert "tool_call_spans" not in served_figures(whole, whole, 3, None)
