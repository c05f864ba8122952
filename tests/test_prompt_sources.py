"""data.sources (eaglenest/data/sources.py, docs/DATA.md): datasets in the shapes people have
(ShareGPT, OpenAI/UltraChat, Alpaca/Magpie) and the containers they come in (JSONL, JSON, Parquet,
save_to_disk), written here through pandas, pyarrow and `datasets`, read into prompts, mixed, and
run through the real read_prompts and split_prompts rules."""

import hashlib
import json
import re

import datasets
import pandas as pd
import pytest

from conftest import edit_config, new_workdir, planned, snakemake
from eaglenest.data import containers
from eaglenest.data.containers import read_records
from eaglenest.data.generate import split_prompts
from eaglenest.data.prompts import read_prompts
from eaglenest.data.sources import read_sources
from eaglenest.evaluate.summary import prompt_sources_line
from eaglenest.report.data import prompt_sources_table, write_prompt_sources_table
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.parts import part_of

SYSTEM = {"role": "system", "content": "Answer in one line."}


def content_id(messages):
    """What docs/DATA.md says a record without an id gets: sha256 of its messages as canonical JSON, 16 hex digits."""
    text = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Two conversations: one with an id, a system prompt and two answered turns; one without an id, a
# single unanswered user turn (non-ASCII, to check the text survives each container)
TWO_TURNS = [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]
ONE_USER = [{"role": "user", "content": "Grüß dich: was ist 7 × 6?"}]
EXPECTED = [
    {"id": "conv-1@1", "messages": TWO_TURNS[:2]},
    {"id": "conv-1@2", "messages": TWO_TURNS[:4]},
    {"id": content_id(ONE_USER), "messages": ONE_USER},
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def records(shape):
    """The two conversations as records of `shape` (the second with a null id, as a column of ids holds)."""
    if shape == "sharegpt":
        return [{"id": id_, "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in msgs]}
                for id_, msgs in (("conv-1", TWO_TURNS), (None, ONE_USER))]
    return [{"id": "conv-1", "messages": TWO_TURNS}, {"id": None, "messages": ONE_USER}]


def write(frame_records, container, path):
    """Write records to `path` in `container`, through pandas, pyarrow (to_parquet) or datasets."""
    frame = pd.DataFrame(frame_records)
    if container == "jsonl":
        frame.to_json(path, orient="records", lines=True, force_ascii=False)
    elif container == "json":
        frame.to_json(path, orient="records", force_ascii=False)
    elif container == "parquet":
        frame.to_parquet(path)
    else:
        datasets.Dataset.from_list(frame_records).save_to_disk(str(path))
    return path


def read_back(tmp_path, sources, seed=0):
    counts = read_sources(sources, tmp_path / "out/prompts.jsonl", tmp_path / "out/sources.json", mix_seed=seed)
    lines = (tmp_path / "out/prompts.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines], counts


CONTAINERS = {"jsonl": "data.jsonl", "json": "data.json", "parquet": "data.parquet", "save_to_disk": "saved"}


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("shape", ["sharegpt", "messages"])
def test_each_conversation_shape_in_each_container_gives_one_prompt_per_answered_turn(tmp_path, shape, container):
    path = write(records(shape), container, tmp_path / CONTAINERS[container])
    prompts, counts = read_back(tmp_path, [{"path": str(path)}])
    assert prompts == EXPECTED
    assert counts["sources"] == [{"path": str(path), "shape": shape, "records": 2, "used": 2, "prompts": 3,
                                  "dropped": {"duplicate": 0, "nothing to answer": 0, "not sampled": 0}}]
    # what split_prompts and generation read: eaglenest's own prompts, checked by its own reader
    assert [p[0] for p in read_prompts(tmp_path / "out/prompts.jsonl")] == [p["id"] for p in EXPECTED]


@pytest.mark.parametrize("container", CONTAINERS)
def test_instruction_records_alpaca_and_magpie_give_one_prompt_each(tmp_path, container):
    rows = [{"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
            {"instruction": "Name a prime above 10.", "input": "", "output": "11"}]
    path = write(rows, container, tmp_path / CONTAINERS[container])
    magpie = write([{"uuid": "u1", "instruction": "Say hi.", "response": "Hi!"}], "jsonl", tmp_path / "magpie.jsonl")
    prompts, counts = read_back(tmp_path, [{"path": str(path)}, {"path": str(magpie)}])
    first = [{"role": "user", "content": "Translate to French.\n\nGood morning"}]
    second = [{"role": "user", "content": "Name a prime above 10."}]
    third = [{"role": "user", "content": "Say hi."}]
    assert prompts == [{"id": content_id(first + [{"role": "assistant", "content": "Bonjour"}]), "messages": first},
                       {"id": content_id(second + [{"role": "assistant", "content": "11"}]), "messages": second},
                       {"id": content_id(third + [{"role": "assistant", "content": "Hi!"}]), "messages": third}]
    assert [s["shape"] for s in counts["sources"]] == ["instruction", "instruction"]


def test_eaglenest_prompts_named_as_such_are_taken_as_they_are(tmp_path):
    """shape: prompts keeps a multi-turn prompt whole (its earlier answer is not regenerated), as data.prompts does."""
    prompt = [SYSTEM, {"role": "user", "content": "1?"}, {"role": "assistant", "content": "1"},
              {"role": "user", "content": "2?"}]
    path = write([{"id": "p1", "messages": prompt}], "jsonl", tmp_path / "p.jsonl")
    assert read_back(tmp_path, [{"path": str(path), "shape": "prompts"}])[0] == [{"id": "p1", "messages": prompt}]
    assert [p["id"] for p in read_back(tmp_path, [{"path": str(path)}])[0]] == ["p1@1", "p1@2"]  # auto: a conversation


# Tool use: the OpenAI form (tools, tool_calls, tool turns) and the ShareGPT form of Glaive and
# xLAM-style sets (function_call and observation turns, tools a JSON string): one calculator call,
# its result and the answer. Each gives two prompts: the question (answered by a call) and the
# conversation up to the tool's result (answered in words); the tool result stays the dataset's.
CALCULATOR = {"name": "calculator", "description": "Evaluates an arithmetic expression.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}}
TOOLS = [{"type": "function", "function": CALCULATOR}]
QUESTION = {"role": "user", "content": "What is 12 * 7?"}
OPENAI_TOOL_USE = {"id": "t1", "tools": TOOLS, "messages": [
    QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator",
                                                          "arguments": '{"expression": "12 * 7"}'}}]},
    {"role": "tool", "content": "84", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "12 * 7 = 84."}]}
GLAIVE_TOOL_USE = {"id": "g1", "tools": json.dumps([CALCULATOR]), "conversations": [
    {"from": "human", "value": "What is 12 * 7?"},
    {"from": "function_call", "value": '{"name": "calculator", "arguments": {"expression": "12 * 7"}}'},
    {"from": "observation", "value": "84"},
    {"from": "gpt", "value": "12 * 7 = 84."}]}


def tool_prompts(record_id, call_id, arguments):
    call = {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    after_call = [QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "content": "84", "tool_call_id": call_id}]
    return [{"id": f"{record_id}@1", "messages": [QUESTION], "tools": TOOLS},
            {"id": f"{record_id}@2", "messages": after_call, "tools": TOOLS}]


@pytest.mark.parametrize("container", CONTAINERS)
def test_tool_use_in_the_openai_form_and_the_glaive_form_reads_with_no_converter(tmp_path, container):
    """tools, tool_calls and tool turns as OpenAI has them, and a Glaive-style ShareGPT record, in
    each container: a call without an id gets Kimi's own (functions.NAME:IDX), a tool turn without
    one answers the call before it, arguments stay as given (a JSON string, an object)."""
    openai = write([OPENAI_TOOL_USE], container, tmp_path / ("openai." + CONTAINERS[container]))
    glaive = write([GLAIVE_TOOL_USE], container, tmp_path / ("glaive." + CONTAINERS[container]))
    prompts, counts = read_back(tmp_path, [{"path": str(openai)}, {"path": str(glaive)}])
    assert prompts == (tool_prompts("t1", "call_1", '{"expression": "12 * 7"}')
                       + tool_prompts("g1", "functions.calculator:0", {"expression": "12 * 7"}))
    assert [s["shape"] for s in counts["sources"]] == ["messages", "sharegpt"]
    read = read_prompts(tmp_path / "out/prompts.jsonl")  # what split_prompts and generation read
    assert [(p.id, p.tools) for p in read] == [(p["id"], TOOLS) for p in prompts]


def test_parallel_calls_merge_into_one_turn_and_answer_in_order(tmp_path):
    """Two function_call turns in a row are one assistant turn with two calls; the observations
    answer them in order, and a conversation ending in a tool result gives one more prompt."""
    record = {"conversations": [
        {"from": "human", "value": "12 * 7 and 3 + 4?"},
        {"from": "function_call", "value": '{"name": "calculator", "arguments": {"expression": "12 * 7"}}'},
        {"from": "function_call", "value": '[{"name": "calculator", "arguments": "{\\"expression\\": \\"3 + 4\\"}"}]'},
        {"from": "observation", "value": "84"}, {"from": "observation", "value": "7"}], "id": "p"}
    prompts, _ = read_back(tmp_path, [{"path": str(write([record], "jsonl", tmp_path / "p.jsonl"))}])
    assert [p["id"] for p in prompts] == ["p@1", "p@2"]
    turn, first, second = prompts[1]["messages"][1:]
    assert [c["id"] for c in turn["tool_calls"]] == ["functions.calculator:0", "functions.calculator:1"]
    assert turn["tool_calls"][1]["function"]["arguments"] == '{"expression": "3 + 4"}'
    assert (first["tool_call_id"], second["tool_call_id"]) == ("functions.calculator:0", "functions.calculator:1")


def numbered(n, start=0):
    return [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(start, start + n)]


def test_a_mixture_by_weight_and_count_is_byte_for_byte_reproducible_and_counts_its_drops(tmp_path):
    a = write(numbered(40), "parquet", tmp_path / "a.parquet")
    b = write(numbered(30, 100) + numbered(1, 100), "jsonl", tmp_path / "b.jsonl")  # its last record repeats its first
    c = write([{"conversations": [{"from": "system", "value": "x"}, {"from": "gpt", "value": "hello"}]}]
              + [{"conversations": [{"from": "human", "value": f"c {i}"}]} for i in range(10)], "json", tmp_path / "c.json")
    sources = [{"path": str(a), "weight": 1}, {"path": str(b), "weight": 3}, {"path": str(c), "count": 4}]
    prompts, counts = read_back(tmp_path, sources, seed=7)
    first = (tmp_path / "out/prompts.jsonl").read_bytes()
    # b has 30 distinct records, 3/4 of the weighted mixture: 40 of them in all, 10 from a
    assert [(s["records"], s["used"], s["prompts"], s["dropped"]) for s in counts["sources"]] == [
        (40, 10, 10, {"duplicate": 0, "nothing to answer": 0, "not sampled": 30}),
        (31, 30, 30, {"duplicate": 1, "nothing to answer": 0, "not sampled": 0}),
        (11, 4, 4, {"duplicate": 0, "nothing to answer": 1, "not sampled": 6})]
    assert counts["prompts"] == len(prompts) == 44
    assert json.loads((tmp_path / "out/sources.json").read_text()) == counts
    read_back(tmp_path, sources, seed=7)
    assert (tmp_path / "out/prompts.jsonl").read_bytes() == first
    other_seed = read_back(tmp_path, sources, seed=8)[0]
    assert {p["id"] for p in other_seed[:10]} != {p["id"] for p in prompts[:10]}  # the seed picks a's records


def test_appending_records_changes_a_sampled_source_by_what_they_displace_only(tmp_path):
    path = tmp_path / "a.jsonl"
    write(numbered(50), "jsonl", path)
    before = [p["id"] for p in read_back(tmp_path, [{"path": str(path), "count": 20}])[0]]
    write(numbered(55), "jsonl", path)  # 5 records appended
    after = [p["id"] for p in read_back(tmp_path, [{"path": str(path), "count": 20}])[0]]
    gained = set(after) - set(before)
    assert len(after) == 20 and len(gained) <= 5
    assert gained <= {content_id(r["messages"]) for r in numbered(5, 50)}  # only appended records come in
    every = read_back(tmp_path, [{"path": str(path)}])[0]  # all records: the old prompts, then the new, in order
    write(numbered(50), "jsonl", path)
    assert every[:50] == read_back(tmp_path, [{"path": str(path)}])[0]


def test_split_prompts_puts_the_prompts_of_the_appended_records_only_in_the_parts_that_gain_them(tmp_path):
    path = tmp_path / "a.parquet"
    write(numbered(60), "parquet", path)
    read_back(tmp_path, [{"path": str(path)}])
    split_prompts(tmp_path / "out/prompts.jsonl", tmp_path / "before", 8)
    write(numbered(61), "parquet", path)
    new_id = read_back(tmp_path, [{"path": str(path)}])[0][-1]["id"]
    split_prompts(tmp_path / "out/prompts.jsonl", tmp_path / "after", 8)
    changed = [f.name for f in sorted((tmp_path / "after").glob("*.jsonl"))
               if f.read_bytes() != (tmp_path / "before" / f.name).read_bytes()]
    assert len(changed) == 1 and new_id in (tmp_path / "after" / changed[0]).read_text()


BAD = {
    "unknown shape": ([{"text": "hello"}], "no field 'conversations' (ShareGPT), 'messages'", "fields: text"),
    "a role the template cannot take": (
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "{}"}]}],
        "field 'conversations[1].from': 'robot' is no role the chat template takes", None),
    "a tool turn answering no call": (
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "observation", "value": "{}"}]}],
        "field 'conversations[1].from': a tool turn answering no call", None),
    "a tool call without a function name": (
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": None, "arguments": "{}"}}]}]}],
        "field 'messages[1].tool_calls[0].function.name': a tool call needs a function name", None),
    "arguments neither a JSON string nor an object": (
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "x = 1"}}]}]}],
        "field 'messages[1].tool_calls[0].function.arguments': expected a JSON object or a string holding one, "
        'got "x = 1"', None),
    "a tool_call_id answering no call": (
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "1", "tool_call_id": "c2"}]}],
        "field 'messages[2].tool_call_id': 'c2' answers no call (unanswered: c1)", None),
    "an empty conversation": ([{"messages": [{"role": "user", "content": "ok"}]}, {"messages": []}],
                              "field 'messages': empty conversation", None),
}
WHERE = {"jsonl": "{path}:{line}", "parquet": "{path}: row {row}", "save_to_disk": "{path}: row {row}",
         "json": "{path}: record {row}"}


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("case", BAD)
def test_bad_input_names_file_record_and_field_and_writes_nothing(tmp_path, case, container):
    rows, problem, extra = BAD[case]
    good = write(numbered(3), "jsonl", tmp_path / "good.jsonl")  # a first source read whole before the bad one
    bad = write(rows, container, tmp_path / CONTAINERS[container])
    with pytest.raises(InputError) as error:
        read_back(tmp_path, [{"path": str(good)}, {"path": str(bad)}])
    where = WHERE[container].format(path=bad, line=len(rows), row=len(rows) - 1)
    assert str(error.value).startswith(f"{where}: ") and problem in str(error.value)
    assert extra is None or extra in str(error.value)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_same_id_with_other_messages_is_refused_naming_both_records(tmp_path):
    a = write([{"id": "x", "messages": [{"role": "user", "content": "one"}]}], "jsonl", tmp_path / "a.jsonl")
    b = write([{"id": "x", "messages": [{"role": "user", "content": "two"}]}], "parquet", tmp_path / "b.parquet")
    with pytest.raises(InputError, match=rf"^{b}: row 0: field 'id': 'x' again, with other messages than at {a}:1$"):
        read_back(tmp_path, [{"path": str(a)}, {"path": str(b)}])


def test_an_integer_id_is_its_string_in_data_prompts_as_in_data_sources_and_a_bad_id_the_same_error(tmp_path):
    """data.prompts and a source of shape prompts take one file alike: the integer id 7 is "7"
    in both (split_prompts sends it to the part of "7"), a boolean id is refused in the same words."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 7, "messages": [{"role": "user", "content": "seven?"}]}\n'
                    '{"id": "x", "messages": [{"role": "user", "content": "ex?"}]}\n')
    assert [p.id for p in read_prompts(path)] == ["7", "x"]
    prompts, _ = read_back(tmp_path, [{"path": str(path), "shape": "prompts"}])
    assert [p["id"] for p in prompts] == ["7", "x"]
    split_prompts(path, tmp_path / "parts", 4)
    assert '"id": 7' in (tmp_path / f"parts/part_{part_of('7', 4):05d}.jsonl").read_text()
    path.write_text('{"id": true, "messages": [{"role": "user", "content": "yes?"}]}\n')
    message = f"{path}:1: field 'id': expected a non-empty string or an integer, got true"
    assert one_line_error(lambda: read_prompts(path)) == message
    assert one_line_error(lambda: read_back(tmp_path, [{"path": str(path), "shape": "prompts"}])) == message
    assert one_line_error(lambda: read_back(tmp_path, [{"path": str(path), "shape": "messages"}])) == message


def test_a_mixture_without_a_prompt_fails_at_once_naming_its_sources(tmp_path):
    """Records with nothing to answer (an assistant turn alone) and duplicates: read_prompts fails,
    not a later stage on the empty prompts file, and writes nothing."""
    unanswerable = [{"messages": [{"role": "assistant", "content": f"hello {i}"}]} for i in range(3)]
    a = write(unanswerable, "jsonl", tmp_path / "a.jsonl")
    b = write(unanswerable[:2], "parquet", tmp_path / "b.parquet")
    assert one_line_error(lambda: read_back(tmp_path, [{"path": str(a)}, {"path": str(b), "weight": 1}])) == (
        f"config: data.sources: the mixture gives no prompt ({a}: 3 records, 0 giving prompts, 3 dropped as nothing "
        f"to answer; {b}: 2 records, 0 giving prompts, 2 dropped as duplicate)")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_count_above_what_a_source_has_and_a_dataset_dict_are_refused_clearly(tmp_path):
    a = write(numbered(3), "jsonl", tmp_path / "a.jsonl")
    with pytest.raises(InputError, match=r"^config: data.sources\[0\].count: 5 records asked of .*a.jsonl, which gives 3$"):
        read_back(tmp_path, [{"path": str(a), "count": 5}])
    datasets.DatasetDict({"train": datasets.Dataset.from_list(numbered(2))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"a DatasetDict \(splits train\): give one split's folder, e.g. .*dd/train$"):
        read_back(tmp_path, [{"path": str(tmp_path / "dd")}])


def test_a_sharegpt_jsonl_and_an_ultrachat_parquet_mixed_by_weight_run_through_split_prompts(tmp_path):
    """The issue's "done when": no converter, the real read_prompts and split_prompts rules."""
    workdir = new_workdir(tmp_path)
    sharegpt = [{"id": f"sg-{i}", "conversations": [{"from": "human", "value": f"Tell me about {i}."},
                                                     {"from": "gpt", "value": "Sure."},
                                                     {"from": "human", "value": "More?"}]} for i in range(20)]
    ultrachat = [{"prompt": f"Explain {i}.", "prompt_id": f"{i:064x}",
                  "messages": [{"role": "user", "content": f"Explain {i}."}, {"role": "assistant", "content": "Ok."}]}
                 for i in range(30)]
    write(sharegpt, "jsonl", workdir / "sharegpt.jsonl")
    pd.DataFrame(ultrachat).to_parquet(workdir / "ultrachat.parquet")
    edit_config(workdir, {"data": {"prompts": None, "mix_seed": 3, "sources": [
        {"path": "sharegpt.jsonl", "weight": 1}, {"path": "ultrachat.parquet", "weight": 1}]}})
    assert {"read_prompts", "split_prompts"} <= planned(workdir).keys()
    snakemake(workdir, "split_prompts")
    prompts = [json.loads(line) for line in (workdir / "results/prompts/prompts.jsonl").read_text().splitlines()]
    counts = json.loads((workdir / "results/prompts/sources.json").read_text())
    # 20 ShareGPT conversations of two prompts each, and as many of UltraChat's 30 records (weights 1:1)
    assert [(s["shape"], s["used"], s["prompts"]) for s in counts["sources"]] == [("sharegpt", 20, 40), ("messages", 20, 20)]
    assert [p["id"] for p in prompts[:2]] == ["sg-0@1", "sg-0@2"]
    assert prompts[1]["messages"][-1] == {"role": "user", "content": "More?"}
    parts = sorted((workdir / "results/responses/prompts").glob("part_*.jsonl"))
    assert len(parts) == 4
    assert sorted(line for part in parts for line in part.read_text().splitlines()) == sorted(
        (workdir / "results/prompts/prompts.jsonl").read_text().splitlines())
    # what the summary and the report say of it
    line = prompt_sources_line(workdir / "results/prompts/sources.json")
    assert line == ("- prompts: 60 from 2 sources (mix_seed 3): sharegpt.jsonl (sharegpt): 40 prompts from 20 of 20 "
                    "records (dropped: none); ultrachat.parquet (messages): 20 prompts from 20 of 30 records "
                    "(dropped: 10 not sampled)")
    table = prompt_sources_table(workdir / "results/prompts/sources.json")
    assert table[["source", "records", "used", "dropped: not sampled", "prompts"]].values.tolist() == [
        ["sharegpt.jsonl", "20", "20", "0", "40"], ["ultrachat.parquet", "30", "20", "10", "20"]]
    write_prompt_sources_table(workdir / "results/prompts/sources.json", tmp_path / "table.html")
    page = " ".join(re.sub(r"<[^>]+>", " ", (tmp_path / "table.html").read_text()).split())
    assert "60 prompts in all." in page and "ultrachat.parquet messages 30 20 0 10 0 20" in page


def test_data_prompts_and_data_sources_are_one_or_the_other(tmp_path):
    workdir = new_workdir(tmp_path)
    edit_config(workdir, {"data": {"sources": [{"path": "resources/demo/prompts.jsonl", "shape": "prompts"}]}})
    result = snakemake(workdir, "-n", check=False)
    assert result.returncode != 0 and "config: data.prompts, data.sources: give one of them" in result.stdout + result.stderr
    (tmp_path / "plain").mkdir()
    assert "read_prompts" not in planned(new_workdir(tmp_path / "plain"))  # data.prompts: no reading stage


def one_line_error(call):
    """The InputError `call()` raises, as text: one line, as every bad input's."""
    with pytest.raises(InputError) as error:
        call()
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_file_that_is_no_text_a_missing_arrow_file_and_a_broken_dataset_dict_are_one_line_errors(tmp_path):
    parquet = write(numbered(3), "parquet", tmp_path / "data.bin")  # Parquet, but not named so: read as text
    assert one_line_error(lambda: list(read_records(parquet))) == (
        f"{parquet}: not UTF-8 text, so neither JSON nor JSONL (Parquet and Arrow files are told by their suffix: "
        "name it .parquet or .arrow)")
    jsonl = write(numbered(300), "jsonl", tmp_path / "late.jsonl")  # a bad byte past the first block decoded
    jsonl.write_bytes(jsonl.read_bytes() + b'{"messages": "\xff"}\n')
    assert re.fullmatch(rf"{jsonl}: not UTF-8 text after line \d+", one_line_error(lambda: list(read_records(jsonl))))
    saved = write(numbered(3), "save_to_disk", tmp_path / "saved")
    [arrow] = saved.glob("*.arrow")
    arrow.unlink()
    assert one_line_error(lambda: read_records(saved)) == (
        f"{saved / 'state.json'}: field '_data_files': {arrow.name} is not in {saved}")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(numbered(2))}).save_to_disk(str(tmp_path / "dd"))
    (tmp_path / "dd/dataset_dict.json").write_text('{"splits": ["train"]')
    assert one_line_error(lambda: read_records(tmp_path / "dd")) == (
        f"{tmp_path / 'dd/dataset_dict.json'}:1: malformed JSON: Expecting ',' delimiter (column 21)")
    (tmp_path / "dd/dataset_dict.json").write_text('{"splits": "train"}')
    assert one_line_error(lambda: read_records(tmp_path / "dd")) == (
        f"{tmp_path / 'dd/dataset_dict.json'}: field 'splits': missing, or not a list of split names")


ARRAYS = {  # JSON arrays of records, well and badly formed, each read in chunks of every size below
    "pandas": None,  # written by pandas' to_json (records), as in the containers above
    "spaced": ' \n[ {"a": 12345, "b": [1.5e3, true, null]} ,\n\n  {"c": "x\\"y\\u00e9 ]"}, 7 ]\n',
    "empty": "[\n]",
    "numbers at the ends of chunks": "[1234567890, -0.125e-3, 98765, false]",
    "malformed record": '[{"a": 1},\n  {"b": 2,, "c": 3}]',
    "unterminated": '[{"a": 1},\n {"b": "two',
    "no comma": '[{"a": 1}\n {"b": 2}]',
    "trailing comma": '[{"a": 1},\n]',
    "extra data": '[{"a": 1}]\n{"b": 2}',
    "no closing bracket": '[{"a": 1}',
}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
@pytest.mark.parametrize("case", ARRAYS)
def test_a_json_array_is_read_record_by_record_as_json_load_reads_it_whole(tmp_path, monkeypatch, case, chunk):
    """containers.JSON_CHUNK characters at a time: the same records as json.load, or the same
    error line and column, whatever the chunks cut (a number, a string, an escape, the blanks)."""
    path = tmp_path / "data.json"
    if ARRAYS[case] is None:
        write(records("messages") * 3, "json", path)
    else:
        path.write_text(ARRAYS[case], encoding="utf-8")
    monkeypatch.setattr(containers, "JSON_CHUNK", chunk)
    try:
        expected = [(f"{path}: record {i}", record) for i, record in enumerate(json.loads(path.read_text()))]
    except json.JSONDecodeError as e:
        message = one_line_error(lambda: list(read_records(path)))
        assert message.startswith(f"{path}:{e.lineno}: malformed JSON: ") and message.endswith(f"(column {e.colno})")
    else:
        assert list(read_records(path)) == expected
