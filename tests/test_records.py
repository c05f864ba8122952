"""Reading raw records: both shapes, and errors that name file, line and field."""

import json

import pytest

from eaglenest.data.records import read_records
from eaglenest.workflow.errors import InputError

GOOD = {
    "id": "a",
    "messages": [{"role": "user", "content": "What is 2 + 2?"}],
    "reasoning_content": "2 + 2 = 4.",
    "content": "4",
    "finish_reason": "stop",
}


def write_lines(path, lines):
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) for line in lines))
    return path


def test_canonical_and_openai_records(tmp_path):
    openai = {
        "messages": [{"role": "user", "content": "hi"}],
        "response": {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
                    "finish_reason": "length",
                    "token_ids": [7, 8],
                }
            ],
        },
    }
    path = write_lines(tmp_path / "r.jsonl", [GOOD, "\n", openai, "\n", GOOD | {"id": "a#1", "temperature": 1.0}])
    a, b, sampled = read_records(path)
    assert (a.id, a.reasoning_content, a.content, a.finish_reason, a.prompt_token_ids) == ("a", "2 + 2 = 4.", "4", "stop", None)
    assert a.where == f"{path}:1"
    assert (a.temperature, b.temperature, sampled.temperature) == (None, None, 1.0)  # optional: made elsewhere
    assert (b.id, b.reasoning_content, b.content, b.finish_reason) == ("chatcmpl-1", "greet", "hello", "length")
    assert (b.prompt_token_ids, b.completion_token_ids) == ([1, 2, 3], [7, 8])


@pytest.mark.parametrize(
    "second_line, expected",
    [
        ('{"id": "b", "messages": [', r"r\.jsonl:2: malformed JSON"),
        ({k: v for k, v in GOOD.items() if k != "content"} | {"id": "b"}, r"r\.jsonl:2: field 'content': missing"),
        (GOOD | {"id": "b", "content": 5}, r"r\.jsonl:2: field 'content': expected str, got int"),
        (GOOD | {"id": "b", "messages": [{"role": "robot", "content": "x"}]}, r"r\.jsonl:2: field 'messages\[0\]\.role'"),
        (GOOD | {"id": "b", "messages": [{"role": "user", "content": None}]}, r"r\.jsonl:2: field 'messages\[0\]\.content': expected str"),
        (GOOD | {"id": "b", "finish_reason": "tool_calls"}, r"r\.jsonl:2: field 'finish_reason'"),
        (GOOD, r"r\.jsonl:2: field 'id': duplicate id 'a' \(first on line 1\)"),
        (GOOD | {"id": "b", "prompt_token_ids": [1, "x"], "completion_token_ids": [2]}, r"r\.jsonl:2: field 'prompt_token_ids'"),
        (GOOD | {"id": "b", "prompt_token_ids": [1]}, r"r\.jsonl:2: field 'prompt_token_ids'/'completion_token_ids': give both"),
        (GOOD | {"id": "b", "temperature": "hot"}, r"r\.jsonl:2: field 'temperature': expected int/float, got str"),
        (GOOD | {"id": "b", "temperature": -1}, r"r\.jsonl:2: field 'temperature': expected a number >= 0, got -1"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, second_line, expected):
    path = write_lines(tmp_path / "r.jsonl", [GOOD, "\n", second_line, "\n"])
    with pytest.raises(InputError, match=expected):
        read_records(path)


def test_empty_file_is_an_error(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", ["\n"])
    with pytest.raises(InputError, match=r"r\.jsonl: no records \(empty file\)"):
        read_records(path)
