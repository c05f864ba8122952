"""run_stage: the rule's log holds what went wrong, as Snakemake points the user there."""

import logging

import pytest

from eaglenest.workflow.errors import InputError
from eaglenest.workflow.stage import run_stage


def bad_input():
    raise InputError("raw.jsonl:3: field 'content': expected str, got int")


def broken_stage():
    return {}["missing"]


@pytest.fixture(autouse=True)
def no_stage_handlers():
    yield
    logging.getLogger().handlers.clear()  # run_stage's log file handler: not into later tests


def test_bad_input_is_one_line_in_the_log(tmp_path):
    log = tmp_path / "stage.log"
    with pytest.raises(SystemExit, match="error: raw.jsonl:3: field 'content'"):
        run_stage(log, 1, bad_input)
    text = log.read_text()
    assert "raw.jsonl:3: field 'content': expected str, got int" in text
    assert "Traceback" not in text


def test_other_errors_leave_their_traceback_in_the_log(tmp_path):
    log = tmp_path / "stage.log"
    with pytest.raises(SystemExit, match=r"error: KeyError: 'missing' \(traceback in .*stage.log\)"):
        run_stage(log, 1, broken_stage)
    text = log.read_text()
    assert "broken_stage failed" in text and "Traceback (most recent call last)" in text
    assert 'return {}["missing"]' in text and "KeyError: 'missing'" in text
