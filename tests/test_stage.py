"""run_stage: the rule's log holds what went wrong, as Snakemake points the user there; the job's
process ends as a normal exit would, less the interpreter's teardown."""

import logging
import subprocess
import sys

import pytest

from conftest import REPO
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


# A job whose stage leaves a non-daemon thread writing, an atexit handler and unflushed output behind.
JOB = """
import atexit, sys, threading, time
from eaglenest.workflow.stage import run_stage

def stage(folder):
    def late():
        time.sleep(0.5)
        open(folder + "/thread", "w").write("joined")
    threading.Thread(target=late).start()
    atexit.register(lambda: open(folder + "/atexit", "w").write("ran"))
    sys.stdout.write("unflushed")
    return "ignored"

run_stage(sys.argv[2], 1, stage, sys.argv[1])
raise AssertionError("run_stage returned")
"""


def test_a_job_ends_after_its_threads_and_atexit_handlers_with_its_output_flushed(tmp_path):
    job = subprocess.run([sys.executable, "-c", JOB, str(tmp_path), str(tmp_path / "stage.log")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert (job.returncode, job.stdout, job.stderr) == (0, "unflushed", "")
    assert (tmp_path / "thread").read_text() == "joined" and (tmp_path / "atexit").read_text() == "ran"
