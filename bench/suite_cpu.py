"""Benchmark: where the test suite's CPU goes, by kind of process.

The suite is CPU-bound on CI's two cores (BENCHMARKS.md, "The suite"), so what limits it is the
CPU-seconds its processes use, most of them in processes pytest never waits for (engine services,
vLLM's spawned workers, SLURM's job steps). This runs a command (by default `make test`) and reads
/proc every second meanwhile: for each process, its command line and its CPU time (user + system,
its own, not its children's). At the end it prints the CPU-seconds of the processes started after
the command, grouped by kind: a rule's script by rule, Snakemake runs and dry runs, engine
services, pytest's workers, and so on. A process shorter than a second may be missed, and the last
second of each is not counted: the figures are a floor.

    python3 bench/suite_cpu.py               # in a fresh clone: make test (setup included), ~21 min
    python3 bench/suite_cpu.py -- make demo   # any other command (standard library only)
"""

import collections
import os
import re
import subprocess
import sys
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")


def sample(seen, stop):
    """Every second until `stop`: {(pid, start): [command line, CPU-seconds]} of every process."""
    while not stop.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                key = (pid, int(fields[19]))
                if key not in seen:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        seen[key] = [f.read().replace(b"\0", b" ").decode(errors="replace"), 0.0]
                seen[key][1] = (int(fields[11]) + int(fields[12])) / TICK
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
        stop.wait(1)


def kind(command):
    """What a process is, from its command line."""
    script = re.search(r"\.snakemake/scripts/tmp\w+\.(\w+)\.py", command)
    if script:
        return f"rule script: {script[1]}"
    if "-m snakemake" in command or "bin/snakemake" in command:
        return "snakemake -n" if re.search(r" (-n|--dry-run)\b", command) else "snakemake"
    for marker, name in (("eaglenest.engine.service", "engine service"), ("spawn_main", "multiprocessing spawn (vLLM)"),
                         ("-m eaglenest.train", "torchrun rank"), ("exec(eval(sys.stdin", "pytest worker (in-process tests)"),
                         ("tests/vllm_generate.py", "tests/vllm_generate.py"), ("bench/", "bench script"),
                         ("chrom", "chromium"), ("slurm", "SLURM")):
        if marker in command:
            return name
    return command.split(" ")[0].rsplit("/", 1)[-1] or "(no command line)"


def main(command):
    seen, stop = {}, threading.Event()
    with open("/proc/self/stat") as f:
        ours = int(f.read().rsplit(")", 1)[1].split()[19])  # this process's start: what started later is the command's
    sampler = threading.Thread(target=sample, args=(seen, stop))
    sampler.start()
    started = time.monotonic()
    returncode = subprocess.run(command).returncode
    wall = time.monotonic() - started
    stop.set()
    sampler.join()
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for (pid, start), (command_line, cpu) in seen.items():
        if start >= ours and int(pid) != os.getpid():
            counts = by_kind[kind(command_line)]
            counts[0] += 1
            counts[1] += cpu
    total = sum(cpu for _, cpu in by_kind.values())
    print(f"{' '.join(command)}: exit {returncode}, {wall:.0f} s, {total:.0f} CPU-seconds in "
          f"{sum(n for n, _ in by_kind.values())} processes")
    print(f"{'CPU-s':>8} {'processes':>9} {'each':>6}  kind")
    for name, (n, cpu) in sorted(by_kind.items(), key=lambda item: -item[1][1]):
        print(f"{cpu:8.1f} {n:9d} {cpu / n:6.1f}  {name}")
    return returncode


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[1:] if args[:1] == ["--"] else args or ["make", "test"]))
