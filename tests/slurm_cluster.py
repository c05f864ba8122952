"""A two-node SLURM cluster on this machine, for the tests and for trying profiles/slurm.

Debian's slurm-wlm and munge (`make setup-slurm`), run as root: munged, slurmctld and one slurmd
per node (`slurmd -N n1`, `-N n2`: both nodes are this host, each slurmd on a port of its own),
each in the foreground of a process we start, so its pid is ours to stop. Everything lives in
one folder (configuration, keys, state, spool, logs, pids); nothing in /etc is written but the
link SYSTEM_CONF. The machine is split, not counted twice: each node has half of its cores and
half of its memory (`slurmd -C`), so SLURM never places more work than the machine holds. Both
nodes are in both partitions, `cpu` (the default) and `gpu`, with `gpus` GPUs each as a gres of
type `gpu_model` (device files that are /dev/null: GPU requests are scheduled, nothing is touched).
No accounting daemon: job states come from squeue.

    python tests/slurm_cluster.py start /tmp/slurm    # prints the SLURM_CONF to export
    python tests/slurm_cluster.py stop /tmp/slurm     # cancels the jobs, stops the daemons by pid

A folder can be started again after a stop (its configuration, keys and devices rewritten), and
stop does all it can whatever state the cluster is in: a dead slurmctld only skips the jobs'
cancelling, every daemon of ours is stopped and the /etc link removed. A test session's cluster
records its owner: one whose owner died without stopping it (a killed run) is stopped by the next
start, which would otherwise find the link taken.
"""

import json
import os
import re
import secrets
import signal
import stat
import socket
import subprocess
import sys
import time
from pathlib import Path

# The one place every SLURM command finds without SLURM_CONF, which the jobstep executor strips from
# the srun it starts inside each job (snakemake_executor_plugin_slurm_jobstep, run_job: every
# SLURM_* variable but the job's ids): a link to the cluster's file while it runs, so one local
# cluster at a time per machine (LocalSlurm.start: an abandoned one is stopped, a live one waited for).
SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
GPU_MODEL = "rtx_pro_6000"  # profiles/slurm's gpu_model
GPUS = 8  # per node
NODES = ("n1", "n2")
DAEMONS = ("munged", "slurmctld", *(f"slurmd-{node}" for node in NODES))  # started in this order, stopped in the other


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NODE_FACTS = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")


def machine():
    """{"CPUs": n, ..., "RealMemory": MB}: this machine as slurmd itself reads it (`slurmd -C`)."""
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    fields = dict(item.split("=", 1) for item in line.split())
    return {name: int(fields[name]) for name in NODE_FACTS}


def node_share():
    """One node's share of this machine: half its cores (one where it has a single core: then the
    nodes share it) with their threads, on one socket, and half its memory."""
    facts = machine()
    cores = max(1, facts["SocketsPerBoard"] * facts["CoresPerSocket"] * facts["Boards"] // len(NODES))
    return {"CPUs": cores * facts["ThreadsPerCore"], "Boards": 1, "SocketsPerBoard": 1, "CoresPerSocket": cores,
            "ThreadsPerCore": facts["ThreadsPerCore"], "RealMemory": facts["RealMemory"] // len(NODES)}


def slurm_conf(folder, host, ports, gpu_model, gpus):
    """slurm.conf of the cluster (cons_tres: CPUs, memory and GPUs are what jobs ask). slurmd
    substitutes %n, the node's name, so that each has its own pid file, spool and log (with one
    pid file for both, the second slurmd kills the first: `killing old slurmd[...]`)."""
    facts = " ".join(f"{name}={value}" for name, value in node_share().items())
    return "\n".join([
        "ClusterName=eaglenest",
        f"SlurmctldHost={host}",
        f"SlurmctldPort={ports['slurmctld']}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={folder}/munge.socket",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool/%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",  # no cgroup setup needed
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",  # memory is scheduled: a job asking more than the node is refused
        # Memory is enforced without cgroups: every second the processes of each step are summed
        # from /proc, and a step over its memory is killed, saying so in the job's output (FAILED).
        "JobAcctGatherType=jobacct_gather/linux",
        "JobAcctGatherFrequency=task=1",
        "JobAcctGatherParams=OverMemoryKill",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "KillWait=5",  # a job over its time gets SIGTERM, then SIGKILL 5 s later
        "InactiveLimit=0",
        "GresTypes=gpu",
        "SlurmdDebug=debug2",
        *(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[node]} {facts} "
          f"Gres=gpu:{gpu_model}:{gpus} State=UNKNOWN" for node in NODES),
        f"PartitionName=cpu Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
        f"PartitionName=gpu Nodes={','.join(NODES)} MaxTime=INFINITE State=UP",
        "",
    ])


class LocalSlurm:
    """The cluster in `folder`; `env` is os.environ with SLURM_CONF pointing at it."""

    def __init__(self, folder):
        self.folder = Path(folder).resolve()
        self.conf = self.folder / "slurm.conf"
        self.env = os.environ | {"SLURM_CONF": str(self.conf)}

    def run(self, *args):
        """A SLURM command against this cluster -> its stdout."""
        result = subprocess.run(args, env=self.env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def start(self, gpu_model=GPU_MODEL, gpus=GPUS, timeout_s=60.0, owner=None, wait_s=0.0):
        """Write the configuration, start the daemons, wait until both nodes are idle. A folder
        stopped before is started afresh; one whose daemons run is refused. `owner`: the pid of
        the process that will stop the cluster (a test session's), None for one kept by hand.
        Another cluster holding SYSTEM_CONF is stopped if it is abandoned (its owner died without
        stopping it: a killed test run), waited for up to wait_s if its owner lives, refused if it
        has none (started by hand)."""
        running = [name for name, pid in self.pids().items() if alive(pid)]
        if running:
            raise RuntimeError(f"{', '.join(running)} of the cluster in {self.folder} still run: stop it first "
                               f"(python tests/slurm_cluster.py stop {self.folder})")
        deadline = time.monotonic() + wait_s
        while SYSTEM_CONF.is_symlink():
            holder = LocalSlurm(SYSTEM_CONF.resolve().parent)
            holder_owner = holder.owner()
            if holder.abandoned():
                holder.stop()  # removes the link
            elif holder_owner is None or time.monotonic() > deadline:
                raise RuntimeError(f"{SYSTEM_CONF} links to the cluster in {holder.folder}, which runs"
                                   + (f" for process {holder_owner}" if holder_owner else "")
                                   + f": stop it first (python tests/slurm_cluster.py stop {holder.folder})")
            else:
                time.sleep(1.0)
        if SYSTEM_CONF.exists():
            raise RuntimeError(f"{SYSTEM_CONF} exists and is no cluster's of ours: this machine has a SLURM of its own")
        for sub in ("state", *(f"spool/{node}" for node in NODES)):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o755)  # munged: its socket's folder must be searchable by all
        key = self.folder / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        (self.folder / "munge.socket").unlink(missing_ok=True)  # a stopped munged's: wait for the new one's
        host = socket.gethostname()
        ports = {name: free_port() for name in ("slurmctld", *NODES)}
        self.conf.write_text(slurm_conf(self.folder, host, ports, gpu_model, gpus))
        # Slurm 22.05 drops a GPU without a File ("Removing file-less GPU ... from final GRES list" in
        # slurmd's log) and wants a device there: each gets a character device of its own with
        # /dev/null's numbers (its name's number is its index). Both nodes name the same files, as
        # the nodes of a real cluster each have their /dev/nvidia0-7.
        (self.folder / "dev").mkdir(exist_ok=True)
        for i in range(gpus):
            (self.folder / "dev" / f"gpu{i}").unlink(missing_ok=True)  # an earlier start's
            os.mknod(self.folder / "dev" / f"gpu{i}", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        (self.folder / "gres.conf").write_text("".join(
            f"NodeName={node} Name=gpu Type={gpu_model} File={self.folder}/dev/gpu[0-{gpus - 1}]\n" for node in NODES))
        if owner is None:
            (self.folder / "owner.pid").unlink(missing_ok=True)
        else:
            (self.folder / "owner.pid").write_text(str(owner))
        SYSTEM_CONF.parent.mkdir(exist_ok=True)
        SYSTEM_CONF.symlink_to(self.conf)
        commands = {
            "munged": ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.folder}/munge.socket",
                       f"--pid-file={self.folder}/munged.pid", f"--seed-file={self.folder}/munged.seed"],
            "slurmctld": ["slurmctld", "-D", "-i", "-f", str(self.conf)],
            **{f"slurmd-{node}": ["slurmd", "-D", "-N", node, "-f", str(self.conf)] for node in NODES},
        }
        pids = {}
        try:
            for name in DAEMONS:
                with open(self.folder / f"{name}.out", "w") as out:
                    pids[name] = subprocess.Popen(commands[name], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True).pid
                (self.folder / "pids.json").write_text(json.dumps(pids))
                if name == "munged":
                    self._wait(lambda: (self.folder / "munge.socket").exists(), "munged's socket", timeout_s)
            self._wait(self.idle, f"nodes {', '.join(NODES)} idle in sinfo", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def idle(self):
        try:
            states = self.run("sinfo", "--noheader", "--Node", "--format=%T").split()
            return states == ["idle"] * 2 * len(NODES)  # each node in each partition
        except RuntimeError:
            return False

    def _wait(self, ready, what, timeout_s):
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, pid in self.pids().items():
                if not alive(pid):
                    raise RuntimeError(f"{name} (pid {pid}) exited before {what}; its output:\n"
                                       + (self.folder / f"{name}.out").read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout_s:.0f} s (logs in {self.folder})")
            time.sleep(0.2)

    def pids(self):
        path = self.folder / "pids.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def owner(self):
        path = self.folder / "owner.pid"
        return int(path.read_text()) if path.exists() else None

    def abandoned(self):
        """Whether no one will stop this cluster: none of its daemons runs, or its owner died."""
        owner = self.owner()
        return not any(alive(pid) for pid in self.pids().values()) or (owner is not None and not alive(owner))

    def stop(self, timeout_s=30.0):
        """Cancel every job (where slurmctld and a slurmd live), then stop the daemons we started,
        by pid (SIGKILL after timeout_s), and remove the /etc link: each step whatever the others met."""
        pids = self.pids()
        running = {name for name, pid in pids.items() if alive(pid)}
        try:
            if "slurmctld" in running and any(f"slurmd-{node}" in running for node in NODES):
                subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True)
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline and self.jobs_running():
                    time.sleep(0.5)
        finally:
            for name in reversed(DAEMONS):
                if name in pids:
                    stop_process(pids[name], timeout_s)
            (self.folder / "pids.json").unlink(missing_ok=True)
            (self.folder / "owner.pid").unlink(missing_ok=True)
            if SYSTEM_CONF.is_symlink() and SYSTEM_CONF.resolve() == self.conf:
                SYSTEM_CONF.unlink()

    def jobs_running(self):
        """Whether a job runs or completes; False once slurmctld does not answer (it died: no job will end)."""
        try:
            return bool(self.run("squeue", "--noheader", "--states=running,completing").strip())
        except RuntimeError:
            return False


def alive(pid):
    """Whether `pid` is a live process that is not a zombie of ours (reaped here if it is)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not our child (the CLI's stop): /proc says
    try:
        return re.search(r"\) (\S)", Path(f"/proc/{pid}/stat").read_text())[1] != "Z"
    except FileNotFoundError:
        return False


def stop_process(pid, timeout_s):
    """SIGTERM, then SIGKILL after timeout_s; a process that ends meanwhile is stopped too."""
    try:
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.1)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    action, folder = sys.argv[1:3]
    cluster = LocalSlurm(folder)
    if action == "start":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    elif action == "stop":
        cluster.stop()
    else:
        sys.exit(f"usage: {sys.argv[0]} start|stop FOLDER")
