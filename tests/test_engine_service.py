"""The engine service (eaglenest/engine/service.py) with a stand-in engine
(tests/service_engine.py): one load serves every connection of a run, log lines reach the
caller, errors keep their kind, and the service ends when stopped, when idle, or at once when
the process that owns it is gone."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eaglenest.engine.service import allocation_log, engine_service, stop_services
from eaglenest.workflow.errors import InputError

TESTS = Path(__file__).resolve().parent
FACTORY = "service_engine:Echo"


def gone(pid, timeout_s=15.0):
    """Whether process `pid` ends (or is a zombie) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working directory of its own (services are keyed by it) and the stand-in importable there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    yield tmp_path
    stop_services("test")


def test_one_load_serves_every_connection_and_log_lines_reach_the_caller(here, caplog):
    log_path = here / "engine.log"
    caplog.set_level(logging.INFO)
    with engine_service("test", FACTORY, {"factor": 3}, log_path=log_path) as call:
        assert call("times", 2, lines=2) == 6
        first = call("pid")
    with engine_service("test", FACTORY, {"factor": 3}, log_path=log_path) as call:
        assert call("times", 5) == 15 and call("pid") == first
    with engine_service("test", FACTORY, {"factor": 4}, log_path=log_path) as call:  # other settings: another
        assert call("pid") != first
    messages = [r.getMessage() for r in caplog.records]
    assert "line 1 of 2" in messages and "line 2 of 2" in messages
    assert log_path.read_text().count("target loaded in") == 2
    stop_services("test")
    assert gone(first) and "test engine service stopped" in log_path.read_text()


@pytest.mark.parametrize("factory, together", [(FACTORY, False), ("service_engine:ConcurrentEcho", True)])
def test_jobs_are_served_together_only_by_an_engine_that_serves_concurrently(here, caplog, factory, together):
    """Two jobs connected at once: a serial engine answers one after the other, a concurrent one
    both at the same time; either way each job gets the log lines of its own request only."""
    caplog.set_level(logging.INFO)
    with engine_service("test", factory, {"factor": 1}, log_path=here / "engine.log") as call:
        call("pid")  # started and loaded: the jobs below only connect
    answers = {}

    def job(name):
        with engine_service("test", factory, {"factor": 1}, log_path=here / "engine.log") as call:
            answers[name] = call("hold", 1.0, name), threading.get_ident()

    jobs = [threading.Thread(target=job, args=(name,)) for name in ("a", "b")]
    for thread in jobs:
        thread.start()
    for thread in jobs:
        thread.join()
    (a_start, a_end), (b_start, b_end) = answers["a"][0], answers["b"][0]
    assert (a_start < b_end and b_start < a_end) == together
    for name, (_, thread) in answers.items():
        assert [r.getMessage() for r in caplog.records if r.thread == thread and "holding" in r.getMessage()] \
            == [f"{name} holding"]


def test_errors_keep_their_kind_and_the_service_lives_on(here):
    with engine_service("test", FACTORY, {"factor": 1}, log_path=here / "engine.log") as call:
        with pytest.raises(InputError, match="prompts.jsonl:3: field 'x': bad"):
            call("refuse", "prompts.jsonl:3")
        with pytest.raises(RuntimeError, match=r"the test engine service failed: boom \(traceback in .*engine.log\)"):
            call("crash")
        assert call("times", 7) == 7
    assert "ZeroDivisionError: boom" in (here / "engine.log").read_text()


def test_an_engine_refusing_its_settings_gives_the_usual_error(here):
    with pytest.raises(InputError, match="config.yaml: field 'factor': -1 is negative"):
        with engine_service("test", FACTORY, {"factor": -1}, log_path=here / "engine.log"):
            pass


def test_an_idle_service_ends_by_itself(here):
    with engine_service("test", FACTORY, {"factor": 1}, log_path=here / "engine.log", idle_s=1.0) as call:
        pid = call("pid")
    assert gone(pid) and "idle for 1s: stopping" in (here / "engine.log").read_text()


def test_the_service_ends_at_once_when_its_owner_is_killed(here):
    """The owner is the caller's parent here (no Snakemake above it): kill -9 it and the service,
    still idle-timed for an hour, ends within seconds though its caller lives on."""
    client = here / "client.py"
    client.write_text(
        "import os, time\n"
        "from eaglenest.engine.service import engine_service\n"
        f"with engine_service('test', {FACTORY!r}, {{'factor': 2}}, log_path='engine.log', idle_s=3600) as call:\n"
        "    print(call('pid'), os.getpid(), flush=True)\n"
        "    time.sleep(60)\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    owner = subprocess.Popen(["bash", "-c", f"{sys.executable} {client}; true"], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=here, start_new_session=True)
    pid, caller = map(int, owner.stdout.readline().split())
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    try:
        assert gone(pid) and "is gone: stopping" in (here / "engine.log").read_text()
    finally:
        os.kill(caller, signal.SIGKILL)


def test_a_service_under_slurm_logs_to_a_file_of_its_allocation():
    """Allocations on several nodes (make slurm-phase) never append to one engine log."""
    log = Path("results/logs/hidden_states/engine.log")
    assert allocation_log(log, {}) == log
    assert allocation_log(log, {"SLURM_JOB_ID": "17"}) == Path("results/logs/hidden_states/engine-slurm17.log")
