"""Engine services: one process loads the target once and serves every job of a phase in turn.

Why: a phase of the workflow is many jobs (256 hidden-state shards, 64 generation parts), each
its own Snakemake output for shard-exact staleness and kill safety, but loading Kimi-K2.5 into a
TP-8 vLLM engine takes minutes. So the first job of a phase starts a service holding the loaded
engine, and every job of that phase sends it its work and waits for the result.

How it lives and dies (docs/HIDDEN_STATES.md "One target load per phase"):
- Scoped to one Snakemake run: its key holds the Snakemake process that runs the job (the owner),
  the working directory, the phase and the engine's settings. Another run, or other settings,
  get a service of their own.
- Started by the first job that finds none (under a lock, so jobs starting together start one),
  in a session of its own, with the job's environment: its GPU lease (CUDA_VISIBLE_DEVICES), or
  `gpus` devices that the service leases for itself (then the jobs hold none and may run at once).
  The job waits while the target loads and fails with the tail of the service's log if it dies.
- Each connected job is served in a thread of its own; its requests run one at a time, in
  arrival order, unless the engine says it serves_concurrently (then it takes requests from every
  thread at once: eaglenest.engine.generate.SharedEngine). Log lines of a request go to the requesting
  job's log as well as the service's, so progress shows in the rule's log.
- Ends when the phase's last rule stops it (stop_services: the engine's memory must be free
  before the next phase takes the GPUs), when it has been idle for `idle_s`, or at once (its
  whole process group killed, vLLM's processes included) when the owner is gone: a killed run
  leaves no engine behind.
- Dies mid-phase (out of memory, a crash): the job being served fails (its output is written
  atomically, so nothing partial), and the next job starts a fresh service (one more load).

No torch here. The factory ("module:attribute") builds the engine object from JSON-able keyword
arguments; requests call its methods with picklable arguments.
"""

import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from eaglenest import CHECKOUT
from eaglenest.workflow.errors import InputError
from eaglenest.workflow.gpu_lease import gpu_lease
from eaglenest.workflow.stage import end_process

log = logging.getLogger("eaglenest.engine.service")  # also when run as __main__

IDLE_S = 300.0  # a service with no request for this long ends (a phase's jobs follow each other in seconds)
POLL_S = 1.0


def services_dir():
    """Where services keep their socket and spec: short (a socket path has at most 107 bytes) and private."""
    path = Path(tempfile.gettempdir()) / f"eaglenest-services-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _cmdline(pid):
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def _stat(pid):
    """The fields of /proc/<pid>/stat after the command name: state, parent, ..., start time."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _start_time(pid):
    """The process's start time in clock ticks (with the pid, it names one process for good)."""
    return int(_stat(pid)[19])


def _parent(pid):
    return int(_stat(pid)[1])


def owner():
    """(pid, start time) of the Snakemake process running this job: the nearest ancestor whose
    command is snakemake (a job may run under a shell, as with --use-conda); else the parent."""
    pid = os.getppid()
    while pid > 1:
        args = [Path(a.decode(errors="replace")).name for a in _cmdline(pid)]
        if "snakemake" in args[:3]:
            return pid, _start_time(pid)
        pid = _parent(pid)
    return os.getppid(), _start_time(os.getppid())


def alive(pid, start_time):
    try:
        return _start_time(pid) == start_time
    except (FileNotFoundError, ProcessLookupError):
        return False


def _connect(path):
    """A connection to the service listening at `path`, or None."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return Connection(sock.detach())


def _log_tail(path, lines=30):
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _start(folder, spec, log_path):
    """Start the service of `spec` in `folder`, wait until it listens, return a connection."""
    (folder / "spec.json").write_text(json.dumps(spec))
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "a") as out:
        process = subprocess.Popen([sys.executable, "-m", "eaglenest.engine.service", str(folder)],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    log.info("started the %s engine service (pid %d, log %s); waiting for it to load the target",
             spec["phase"], process.pid, log_path)
    start = time.monotonic()
    while (conn := _connect(folder / "socket")) is None:
        if process.poll() is not None:
            if (folder / "input_error").exists():  # the engine refused its settings: the usual one-line error
                raise InputError((folder / "input_error").read_text())
            raise RuntimeError(f"the {spec['phase']} engine service exited with {process.returncode} while "
                               f"starting; the end of {log_path}:\n{_log_tail(log_path)}")
        time.sleep(POLL_S / 4)
    log.info("the %s engine service is up after %.1fs", spec["phase"], time.monotonic() - start)
    return conn


@contextlib.contextmanager
def engine_service(phase, factory, kwargs, *, log_path, gpus=0, idle_s=IDLE_S):
    """A connection to this run's `phase` service for the engine factory(**kwargs), started if
    there is none; yields a function call(method, *args, **kwargs) -> the method's result.
    gpus: devices the service leases for itself (eaglenest.workflow.gpu_lease) while it lives."""
    log_path = allocation_log(log_path)
    owner_pid, owner_start = owner()
    spec = {"phase": phase, "workdir": os.getcwd(), "owner": [owner_pid, owner_start], "factory": factory,
            "kwargs": kwargs, "gpus": gpus}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    _sweep()
    folder = services_dir() / key
    folder.mkdir(mode=0o700, exist_ok=True)
    with open(folder / "start.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # jobs starting together start one service between them
        conn = _connect(folder / "socket")
        if conn is None:
            conn = _start(folder, spec | {"idle_s": idle_s}, log_path)
        else:
            log.info("using this run's %s engine service (log %s)", phase, log_path)
    with conn:
        yield lambda method, *args, **kw: _call(conn, phase, log_path, method, args, kw)


def allocation_log(log_path, environ=os.environ):
    """Where this allocation's service logs: `log_path`, or under SLURM <name>-slurm<job id><suffix>
    beside it. Services of allocations on several nodes then never append to one file (appends
    from two hosts interleave on a shared file system), and each allocation's loads are its own."""
    job = environ.get("SLURM_JOB_ID")
    path = Path(log_path)
    return path if job is None else path.with_name(f"{path.stem}-slurm{job}{path.suffix}")


def _call(conn, phase, log_path, method, args, kwargs):
    """One request: the service's log lines for it are logged here; its result returned, its error raised."""
    try:
        conn.send(("call", method, args, kwargs))
        while True:
            kind, *body = conn.recv()
            if kind == "log":
                logging.getLogger(body[0]).log(body[1], "%s", body[2])
            elif kind == "done":
                return body[0]
            elif body[0] == "InputError":
                raise InputError(body[1])
            else:
                raise RuntimeError(f"the {phase} engine service failed: {body[1]} (traceback in {log_path})")
    except (EOFError, ConnectionError) as e:
        raise RuntimeError(f"the {phase} engine service died ({type(e).__name__}); the end of {log_path}:\n"
                           f"{_log_tail(log_path)}") from e


def _specs():
    """(folder, spec) of every service of this user whose spec is readable."""
    for spec_path in services_dir().glob("*/spec.json"):
        try:
            yield spec_path.parent, json.loads(spec_path.read_text())
        except (OSError, ValueError):
            continue


def _sweep():
    """Remove what services of runs that are gone left behind (killed with their run, they could not)."""
    for folder, spec in _specs():
        if not alive(*spec["owner"]):
            shutil.rmtree(folder, ignore_errors=True)


def stop_services(phase, *, timeout_s=300.0):
    """Stop this run's `phase` services and wait until they are gone (their GPU memory free)."""
    here = [os.getcwd(), list(owner())]
    for folder, spec in _specs():
        if spec["phase"] != phase or [spec["workdir"], spec["owner"]] != here:
            continue
        try:
            pid = int((folder / "pid").read_text())
        except FileNotFoundError:  # still starting: it will end with its run or when idle
            continue
        conn = _connect(folder / "socket")
        if conn is not None:
            with conn, contextlib.suppress(EOFError, ConnectionError):
                conn.send(("stop",))
                conn.recv()
        deadline = time.monotonic() + timeout_s
        while _process_exists(pid) and time.monotonic() < deadline:
            time.sleep(POLL_S / 4)
        if _process_exists(pid):
            os.killpg(pid, signal.SIGKILL)
        log.info("stopped the %s engine service (pid %d)", phase, pid)


def _process_exists(pid):
    try:
        return _stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False


class _Forward(logging.Handler):
    """Sends eaglenest's log records from the thread serving a job to that job (an engine logs
    a request's progress from the requesting thread); vLLM's own stay in the service's log."""

    def __init__(self, conn):
        super().__init__(logging.INFO)  # Handler.handle holds the handler's lock around emit: one sender at a time
        self.conn, self.thread = conn, threading.get_ident()

    def emit(self, record):
        if record.thread == self.thread and record.name.startswith("eaglenest"):
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(("log", record.name, record.levelno, record.getMessage()))


def _serve(conn, engine, turn, stop):
    """Answer one job's requests until it hangs up (in this job's thread), each while holding
    `turn`; set `stop` when told to stop."""
    with conn:
        while True:
            try:
                message = conn.recv()
            except (EOFError, ConnectionError):
                return
            if message[0] == "stop":
                stop.set()
                conn.send(("stopped",))
                return
            _, method, args, kwargs = message
            forward = _Forward(conn)
            logging.getLogger().addHandler(forward)
            try:
                with turn:
                    reply = ("done", getattr(engine, method)(*args, **kwargs))
            except Exception as e:
                log.exception("%s failed", method)
                reply = ("error", type(e).__name__, str(e))
            finally:
                logging.getLogger().removeHandler(forward)
            with contextlib.suppress(OSError):
                conn.send(reply)


def _watch_owner(owner_pid, owner_start):
    """End the whole service (vLLM's processes too) as soon as the Snakemake run is gone."""
    while alive(owner_pid, owner_start):
        time.sleep(POLL_S)
    log.warning("the Snakemake run (pid %d) is gone: stopping", owner_pid)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main(folder):
    folder = Path(folder)
    spec = json.loads((folder / "spec.json").read_text())
    (folder / "pid").write_text(f"{os.getpid()}\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    threading.Thread(target=_watch_owner, args=spec["owner"], daemon=True).start()
    with gpu_lease(spec["gpus"]):  # sets CUDA_VISIBLE_DEVICES before the engine starts
        engine = _load(folder, spec)
        try:
            _listen(folder, spec, engine)
        finally:
            with contextlib.suppress(Exception):
                engine.close()
            shutil.rmtree(folder, ignore_errors=True)
    log.info("%s engine service stopped", spec["phase"])


def _load(folder, spec):
    """The engine of `spec`; an InputError (settings the engine refuses) is left for the starting job."""
    module, name = spec["factory"].split(":")
    log.info("%s engine service (pid %d) for %s: loading the target", spec["phase"], os.getpid(), spec["workdir"])
    start = time.monotonic()
    try:
        engine = getattr(importlib.import_module(module), name)(**spec["kwargs"])
    except InputError as e:
        log.error("%s", e)
        (folder / "input_error").write_text(str(e))
        sys.exit(1)
    log.info("target loaded in %.1fs", time.monotonic() - start)
    return engine


def _listen(folder, spec, engine):
    """Serve every job that connects, each in a thread of its own, until stopped or idle."""
    turn = contextlib.nullcontext() if getattr(engine, "serves_concurrently", False) else threading.Lock()
    stop, serving = threading.Event(), []
    with contextlib.suppress(FileNotFoundError):
        (folder / "socket").unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / "socket"))
    listener.listen(256)
    listener.settimeout(POLL_S)
    idle_since = time.monotonic()
    try:
        while not stop.is_set():
            serving = [thread for thread in serving if thread.is_alive()]
            if serving:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= spec["idle_s"]:
                log.info("idle for %.0fs: stopping", spec["idle_s"])
                return
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            serving.append(threading.Thread(target=_serve, args=(Connection(sock.detach()), engine, turn, stop),
                                            daemon=True))
            serving[-1].start()
    finally:
        listener.close()
        (folder / "socket").unlink(missing_ok=True)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process()
