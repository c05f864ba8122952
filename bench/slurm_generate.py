"""Benchmark: generation parts across two SLURM allocations, one target load each, against a local
run (issue 55; the suite tests the same command on the extraction shards, tests/test_slurm.py).

On the local two-node cluster (tests/slurm_cluster.py, started in a temporary folder and stopped
after), the demo workflow at a small size: PROMPTS of the demo's prompts at its temperatures (0
and 1), max_tokens MAX_TOKENS, generate.num_parts 4, a briefly trained demo target. split_prompts
and engine_start_check are made first, locally (docs/CLUSTERS.md: what generation reads, before
the phase); then, each in a copy of that workflow, one after the other:
  local    `snakemake --cores 2 <the 4 parts>`: one engine service, two parts at a time
  phase    the command of `make slurm-phase PHASE=generate_part NODES=2` (tests/test_slurm.py's
           slurm_phase): two allocations of a node each (its CPU, its memory, a GPU), parts 0 and 2
           in the first, 1 and 3 in the second, one after another (the node's one core)
  fault    the same, the second allocation cancelled (scancel) once one of its parts is written and
           the other's job has started; then the command run again
Checked (an AssertionError otherwise): each allocation on a node of its own (scontrol show job),
one target load in each allocation's engine log, every part byte for byte the local run's; in the
fault, the part in flight never written, the finished parts untouched (bytes and mtimes) by the
rerun, the rerun submitting the second share alone with its one missing part and one load, no
temporary left. Prints Markdown tables of the wall times. As root, after `make setup-slurm`, with
the cluster lock the SLURM tests' users take:

    flock /tmp/eaglenest-slurm-dev.lock nice -n 10 .venv/bin/python bench/slurm_generate.py
"""

import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from conftest import DEMO_CORPUS, edit_config, new_workdir, snakemake  # noqa: E402  (the tests' workflow copy)
from slurm_cluster import NODES, LocalSlurm  # noqa: E402
from test_slurm import (SUBMITTED_ALLOCATION, field, finished, loads, one_done_one_started, slurm_phase,  # noqa: E402
                        stamps, wait_until)

from eaglenest.demo.target import build_demo_target  # noqa: E402
from eaglenest.workflow.slurm_phase import job_name, live_allocations  # noqa: E402

RULE = "generate_part"
PROMPTS = 80  # of the demo's 2,000, each answered at temperatures 0 and 1: 160 answers, 40 a part
MAX_TOKENS = 32
PARTS = [f"results/responses/parts/part_{i:05d}.jsonl" for i in range(4)]
ALLOCATIONS = [job_name(RULE, i, 2) for i in range(2)]
CONFIG = {"generate": {"max_tokens": MAX_TOKENS, "num_parts": len(PARTS)},
          "vllm": {"gpu_memory_utilization": 0.05}}  # speed only: a KV cache of ~1.2 GB, not 4.8 GB


def base_workflow(folder):
    """The small workflow with split_prompts and engine_start_check made: what every run copies."""
    target = folder / "target"
    build_demo_target(DEMO_CORPUS, target, seed=0, steps=40, batch_size=8, seq_len=128)
    workdir = new_workdir(folder)
    prompts = workdir / "resources/demo/prompts.jsonl"
    prompts.write_text("".join(prompts.read_text().splitlines(keepends=True)[:PROMPTS]))
    edit_config(workdir, CONFIG | {"target": {"demo": False, "path": str(target)}})
    snakemake(workdir, "--until", "split_prompts", "engine_start_check")
    return workdir


def copy(workdir, name):
    shutil.copytree(workdir, workdir.parent / name, symlinks=True)
    return workdir.parent / name


def parts_bytes(workdir):
    return [(workdir / part).read_bytes() for part in PARTS]


def load_seconds(log):
    return [float(s) for s in re.findall(r"target loaded in ([\d.]+)s", log.read_text())]


def timed_phase(slurm, workdir):
    """The command, to its end -> (exit status, output, seconds, {allocation: job id})."""
    start = time.perf_counter()
    returncode, output = finished(slurm_phase(slurm, workdir, RULE))
    seconds = time.perf_counter() - start
    return returncode, output, seconds, {name: job for name, job, _, _ in SUBMITTED_ALLOCATION.findall(output)}


def allocation_facts(slurm, workdir, jobs):
    """{allocation: (node, run time, loads, target load seconds)}; the records are scontrol's while
    slurmctld keeps them (MinJobAge, 300 s)."""
    facts = {}
    for name, job in jobs.items():
        record = slurm.run("scontrol", "show", "job", job)
        facts[name] = (field(record, "NodeList"), field(record, "RunTime"), loads(workdir, job, "generate"),
                       load_seconds(workdir / f"results/logs/generate/engine-slurm{job}.log"))
    return facts


def local_run(workdir):
    start = time.perf_counter()
    snakemake(workdir, *PARTS)
    return time.perf_counter() - start


def phase_run(slurm, workdir, local):
    returncode, output, seconds, jobs = timed_phase(slurm, workdir)
    assert returncode == 0 and sorted(jobs) == ALLOCATIONS, output
    facts = allocation_facts(slurm, workdir, jobs)
    assert sorted(node for node, *_ in facts.values()) == sorted(NODES), facts  # one allocation per node
    assert [facts[name][2] for name in ALLOCATIONS] == [1, 1], facts  # one target load each
    assert parts_bytes(workdir) == parts_bytes(local), "the allocations' parts differ from the local run's"
    return seconds, facts


def fault_run(slurm, workdir, local):
    """The second allocation cancelled mid-share, the command run again -> what each step left, by name."""
    first = slurm_phase(slurm, workdir, RULE)
    start = time.perf_counter()
    wait_until(lambda: one_done_one_started(workdir, PARTS, ALLOCATIONS[1]) or first.poll() is not None,
               "a part of the second allocation written and its other part's job started", timeout_s=900)
    assert first.poll() is None, first.communicate()[0]
    done, in_flight = one_done_one_started(workdir, PARTS, ALLOCATIONS[1])
    jobs = live_allocations(workdir, RULE)
    done_before = stamps(workdir, [done])
    slurm.run("scancel", jobs[ALLOCATIONS[1]])
    returncode, output = finished(first)
    first_s = time.perf_counter() - start
    assert returncode == 1 and output.rstrip().endswith(f"1 {RULE} outputs are still missing or stale "
                                                        f"(logs: {workdir}/.snakemake/slurm_phase/): {in_flight}"), output
    in_flight_written = (workdir / in_flight).exists()
    assert not in_flight_written, f"{in_flight} written though its allocation was cancelled"
    temporaries_after_cancel = [str(path.relative_to(workdir)) for path in (workdir / "results").rglob("*.tmp")]
    finished_parts = [part for part in PARTS if part != in_flight]
    before_rerun = stamps(workdir, finished_parts)
    assert before_rerun[done] == done_before[done]
    first_facts = allocation_facts(slurm, workdir, jobs)
    returncode, output, rerun_s, rerun_jobs = timed_phase(slurm, workdir)
    assert returncode == 0 and list(rerun_jobs) == [ALLOCATIONS[1]], output
    assert SUBMITTED_ALLOCATION.search(output).groups()[2:] == ("1", "2"), output  # 1 of its 2 parts to make
    rerun_facts = allocation_facts(slurm, workdir, rerun_jobs)
    assert rerun_facts[ALLOCATIONS[1]][2] == 1, rerun_facts
    assert stamps(workdir, finished_parts) == before_rerun, "the rerun touched a finished part"
    assert parts_bytes(workdir) == parts_bytes(local), "the parts after the rerun differ from the local run's"
    assert not list((workdir / "results").rglob("*.tmp"))
    return {"first_s": first_s, "rerun_s": rerun_s, "done": done, "in_flight": in_flight, "first": first_facts,
            "rerun": rerun_facts, "temporaries_after_cancel": temporaries_after_cancel}


def main():
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = base_workflow(tmp / "base")
        local = copy(base, "local")
        local_s = local_run(local)
        local_loads = load_seconds(local / "results/logs/generate/engine.log")
        assert len(local_loads) == 1, local_loads
        slurm = LocalSlurm(tmp / "slurm").start(owner=os.getpid())
        try:
            phase_s, phase_facts = phase_run(slurm, copy(base, "phase"), local)
            fault = fault_run(slurm, copy(base, "fault"), local)
        finally:
            slurm.stop()
        answers = sum(part.count(b"\n") for part in parts_bytes(local))
    print(f"{PROMPTS} prompts at temperatures 0 and 1 ({answers} answers), max_tokens {MAX_TOKENS}, {len(PARTS)} parts; "
          "the parts of every cluster run byte-identical to the local run's (checked)\n")
    print("| run | wall time | ratio to local | target loads | target load s | allocations (node, run time) |")
    print("|---|---|---|---|---|---|")
    print(f"| local, `snakemake --cores 2` | {local_s:.1f} s | 1.00 | 1 | {local_loads[0]:.1f} | |")
    print(f"| `make slurm-phase PHASE=generate_part NODES=2` | {phase_s:.1f} s | **{phase_s / local_s:.2f}** | "
          f"{' + '.join(str(facts[2]) for facts in phase_facts.values())} | "
          f"{', '.join(f'{s:.1f}' for facts in phase_facts.values() for s in facts[3])} | "
          f"{'; '.join(f'{name}: {node}, {run}' for name, (node, run, *_) in phase_facts.items())} |")
    print(f"\nThe fault: {ALLOCATIONS[1]} cancelled with {fault['done']} written and {fault['in_flight']}'s job started "
          f"(temporaries left right after the cancel: {fault['temporaries_after_cancel'] or 'none'}; none after the rerun)\n")
    print("| step | wall time | allocations (node, run time, loads) |")
    print("|---|---|---|")
    for step, seconds, facts in (("the command, one allocation cancelled (exit 1)", fault["first_s"], fault["first"]),
                                 ("the command again (exit 0)", fault["rerun_s"], fault["rerun"])):
        print(f"| {step} | {seconds:.1f} s | "
              f"{'; '.join(f'{name}: {node}, {run}, {n}' for name, (node, run, n, _) in facts.items())} |")


if __name__ == "__main__":
    main()
