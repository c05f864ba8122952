"""A GPU phase across N SLURM allocations, one per node, each loading the target once.

Why: through profiles/slurm every shard or part is an sbatch job with a Snakemake of its own, and
each loads the target (docs/CLUSTERS.md, "Job groups: not for GPU phases"). Inside one
allocation, Snakemake's local executor runs the phase's jobs in one Snakemake, whose engine
service loads the target once for all of them (eaglenest.engine.service). This runs one such
allocation per node, each on its own share of the phase's outputs (docs/CLUSTERS.md, "A GPU phase
across nodes"):

- The shares: the phase rule's outputs (`snakemake --summary` of the workflow), sorted; output i
  goes to allocation i mod N. Deterministic, and each shard or part stays its own Snakemake output.
- Everything the phase reads must be up to date first (nothing but the phase's rule planned for
  its outputs): else every allocation would make those inputs again, N writers of one file.
- An allocation is submitted only when its share has something to do, and only while no
  allocation of that share runs or waits (its job name, in squeue). So a rerun of this command,
  after a lost node or after the command itself was killed, submits only the missing work, once.
- Inside, `snakemake --nolock`: the shares are disjoint, nothing else is planned, and one
  allocation per share at a time, so no two runs write one file; and a cancelled allocation's
  Snakemake leaves its lock behind (SIGKILL after SLURM's KillWait, or a lost node), which would
  refuse that share's rerun until an `--unlock` that removes the live allocations' locks too.
- It then waits until its allocations have ended and plans again: exit status 0 only when none of
  the phase's outputs is left to make.

    python -m eaglenest.workflow.slurm_phase hidden_states --nodes 4 -- --partition=gpu --gpus=8 ...

No snakemake import: Snakemake and SLURM are called as the user would call them.
"""

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from eaglenest.workflow.errors import InputError

# The GPU phases: rule -> Snakemake arguments of each allocation's run beyond the common ones.
PHASES = {
    "hidden_states": (),  # its shards one after another on the allocation's GPUs, each a request to the one engine
    # as profiles/blackwell: the generate service holds the GPUs, so every part job runs at once and shares its batch
    "generate_part": ("--set-resources", "generate_part:gpu=0"),
}
POLL_S = 5.0


def snakemake(python, *args):
    """This Snakemake (`python -m snakemake`), without a lock (it writes nothing) -> its stdout."""
    run = subprocess.run([python, "-m", "snakemake", "--nolock", "--rerun-incomplete", *args],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"snakemake {' '.join(args[:2])} ... failed:\n{run.stdout}{run.stderr}")
    return run.stdout


def summary(python, targets=()):
    """[(output, rule, needs a run)] of every job Snakemake plans for `targets` (the workflow's by default)."""
    lines = snakemake(python, "--summary", *targets).splitlines()
    header = lines.index("output_file\tdate\trule\tlog-file(s)\tstatus\tplan")
    rows = [line.split("\t") for line in lines[header + 1:]]
    return [(row[0], row[2], row[-1] != "no update") for row in rows]


def plan(python, rule):
    """(the phase's outputs, sorted; those left to make). Raises InputError when something it reads
    is not up to date."""
    outputs = sorted(output for output, job_rule, _ in summary(python) if job_rule == rule)
    if not outputs:
        raise InputError(f"the workflow has no {rule} jobs (config: is the phase part of this run?)")
    rows = summary(python, outputs)
    before = sorted({job_rule for _, job_rule, pending in rows if pending and job_rule != rule})
    if before:
        raise InputError(f"{rule} reads what {', '.join(before)} must make first: run them before the phase, e.g. "
                         f"snakemake --profile profiles/slurm --until {' '.join(before)}")
    return outputs, {output for output, job_rule, pending in rows if pending and job_rule == rule}


def shares(outputs, nodes):
    """Output i to share i mod `nodes`."""
    return [outputs[i::nodes] for i in range(nodes)]


def job_name(rule, index, nodes):
    return f"eaglenest-{rule}-{index + 1}of{nodes}"


def live_allocations(workdir, rule):
    """{job name: job id} of this phase's allocations from `workdir` that run or wait."""
    listing = subprocess.run(["squeue", "--noheader", "--states=pending,running,configuring,completing",
                              "--format=%i|%j|%Z"], capture_output=True, text=True, check=True).stdout
    rows = (line.split("|") for line in listing.splitlines())
    return {name: job for job, name, folder in rows
            if folder == str(workdir) and name.startswith(f"eaglenest-{rule}-")}


def allocation_command(python, rule, share):
    """The allocation's Snakemake: the local executor on the node's CPUs and GPUs, its share as
    targets (first: --resources and --set-resources take every word up to the next option)."""
    return " ".join(["exec", shlex.quote(python), "-m", "snakemake", *map(shlex.quote, share), "--nolock",
                     "--rerun-incomplete", "--cores", "$SLURM_CPUS_ON_NODE", "--resources", "gpu=${SLURM_GPUS_ON_NODE:-0}",
                     *map(shlex.quote, PHASES[rule])])


def submit(workdir, python, rule, name, share, sbatch_options):
    """sbatch of one allocation of one node -> its job id. Its log: .snakemake/slurm_phase/<name>-<job id>.log."""
    logs = workdir / ".snakemake" / "slurm_phase"
    logs.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--job-name={name}", f"--chdir={workdir}",
                          f"--output={logs}/{name}-%j.log", *sbatch_options,
                          f"--wrap={allocation_command(python, rule, share)}"],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"sbatch of {name} failed: {run.stderr.strip()}")
    return run.stdout.strip().split(";")[0]


def run_phase(rule, nodes, sbatch_options, workdir=None, python=sys.executable):
    """Make the phase's outputs that are left in `nodes` allocations, wait for them -> exit status."""
    workdir = Path(workdir or Path.cwd()).resolve()
    outputs, pending = plan(python, rule)
    live = live_allocations(workdir, rule)
    names = [job_name(rule, i, nodes) for i in range(nodes)]
    foreign = sorted(set(live) - set(names))
    if foreign:
        raise InputError(f"allocations of another split of {rule} still run or wait ({', '.join(foreign)}): "
                         f"wait for them or scancel {' '.join(live[name] for name in foreign)}")
    jobs = {}
    for name, share in zip(names, shares(outputs, nodes)):
        if name in live:
            print(f"{name}: job {live[name]} runs or waits already, not submitted again", flush=True)
            jobs[name] = live[name]
        elif pending & set(share):
            jobs[name] = submit(workdir, python, rule, name, share, sbatch_options)
            print(f"{name}: job {jobs[name]}, {len(pending & set(share))} of its {len(share)} outputs to make",
                  flush=True)
    while live_allocations(workdir, rule).keys() & jobs.keys():
        time.sleep(POLL_S)
    _, left = plan(python, rule)
    if left:
        print(f"{len(left)} {rule} outputs are still missing or stale (logs: {workdir}/.snakemake/slurm_phase/): "
              f"{' '.join(sorted(left))}", file=sys.stderr)
        return 1
    print(f"every {rule} output is made ({len(outputs)})")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, sbatch_options = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     usage="%(prog)s RULE --nodes N [-- SBATCH OPTIONS of each allocation]")
    parser.add_argument("rule", choices=sorted(PHASES))
    parser.add_argument("--nodes", type=int, required=True, help="allocations, one node each")
    args = parser.parse_args(ours)
    try:
        return run_phase(args.rule, args.nodes, sbatch_options)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
