"""The blackwell, slurm and kubernetes profiles: they load, plan every job with the right
resources, and lint clean. Dry runs only (`-n -F`: every job planned whatever results/ holds)."""

import json
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from eaglenest.train.launch import torchrun_command

GPU_RULES = {"engine_start_check", "generate_part", "hidden_states", "train_drafter", "vllm_baseline", "vllm_speculative", "agreement_states",
             "evaluate_vllm", "evaluate_offline"}
# one GPU and no target loaded: a drafter's memory, or vLLM's backend selection on configs alone
DRAFTER_ONLY = {"evaluate_offline", "evaluate_vllm", "engine_start_check"}
CPU_STAGES = {"tokenize", "token_freq", "vocab_map", "eval_prompts"}  # run beside GPU jobs: they hold no GPU
TP, TRAIN_GPUS = 8, 8
GPU_CONFIG = {  # the 8-GPU container's kind of target: tensor parallelism 8, DDP on 8 GPUs
    "vllm": {"tensor_parallel_size": TP, "dtype": "auto"},
    "hidden_states": {"device": "cuda", "backend": "vllm"},
    "train": {"device": "cuda", "num_processes": TRAIN_GPUS},
}
EXPECTED_GPUS = {"engine_start_check": 1, "generate_part": TP, "hidden_states": TP, "train_drafter": TRAIN_GPUS, "vllm_baseline": TP,
                 "vllm_speculative": TP, "agreement_states": TP, "evaluate_vllm": 1, "evaluate_offline": 1}


# The cluster executors live in .venv-cluster (`make setup-cluster`), layered over this venv.
CLUSTER_PYTHON = REPO / ".venv-cluster" / "bin" / "python"


def snakemake(*args, python=sys.executable):
    """Snakemake run as a person would from the repository root (a cluster profile: from
    .venv-cluster)."""
    assert Path(python).exists(), f"{python} is missing: run `make setup-cluster`"
    result = subprocess.run([python, "-m", "snakemake", *args], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"snakemake {args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def planned(output):
    """[(rule, {resource: value as printed})] of every job in a dry run's output."""
    jobs = []
    for job in re.finditer(r"^(?:local)?(?:rule|checkpoint) (\w+):\n((?:[ \t]+.*\n?)*)", output, re.M):
        line = re.search(r"^\s+resources: (.*)$", job[2], re.M)[1]
        jobs.append((job[1], dict(item.split("=", 1) for item in line.split(", "))))
    return jobs


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "gpu.yaml"
    path.write_text(yaml.safe_dump(GPU_CONFIG))
    return path


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """The Kubernetes profile's storage (fs provider) with the workflow's inputs put there, as the
    docs say; the dry run checks what exists there."""
    prefix = tmp_path_factory.mktemp("storage")
    shutil.copytree(REPO / "resources", prefix / "resources")
    return prefix


PROFILES = {  # name: the extra arguments its dry run needs here
    "blackwell": [],  # exactly as typed: a name, found in the working directory
    "profiles/slurm": [],
    "profiles/kubernetes": ["--default-storage-prefix", "{storage}"],
}


def profile_args(profile, storage):
    return ["--profile", profile, *(a.format(storage=storage) for a in PROFILES[profile])]


def python_for(profile):
    return sys.executable if profile == "blackwell" else CLUSTER_PYTHON


def test_cluster_executors_stay_out_of_the_workflow_venv():
    """Snakemake imports every installed plugin on each call (the kubernetes client and pandas
    slow every dry run: BENCHMARKS.md), so they live in .venv-cluster, which sees the workflow
    venv too."""
    prefixes = ("snakemake_executor_plugin_", "snakemake_storage_plugin_")
    assert [m.name for m in pkgutil.iter_modules() if m.name.startswith(prefixes)] == []
    listed = subprocess.run([CLUSTER_PYTHON, "-c", "import json, pkgutil, eaglenest, torch\n"  # layered: sees both
                             f"print(json.dumps(sorted(m.name for m in pkgutil.iter_modules() if m.name.startswith({prefixes}))))"],
                            capture_output=True, text=True, check=True).stdout
    assert json.loads(listed) == ["snakemake_executor_plugin_kubernetes", "snakemake_executor_plugin_slurm",
                                  "snakemake_executor_plugin_slurm_jobstep", "snakemake_storage_plugin_fs"]


RULE_OR_ALL_CORES = re.compile(r"^\s*(?:local)?rule (\w+):|^\s*threads: lambda wildcards: workflow\.cores\b", re.M)


def rules_taking_all_cores():
    """The rules whose threads are Snakemake's --cores (`threads: lambda wildcards: workflow.cores`)."""
    found = set()
    for path in (REPO / "rules").glob("*.smk"):
        rule = None
        for match in RULE_OR_ALL_CORES.finditer(path.read_text()):
            if match[1]:
                rule = match[1]
            else:
                found.add(rule)
    return found


@pytest.mark.parametrize("profile", ["profiles/slurm", "profiles/kubernetes"])
def test_a_cluster_profile_gives_threads_to_every_rule_that_takes_all_cores(profile):
    """A cluster run has no --cores, so such a rule's job fails with "Workflow requires a total
    number of cores to be defined" when it is submitted, unless the profile sets its threads; a
    dry run never asks (found running the demo through sbatch: docs/CLUSTERS.md)."""
    settings = yaml.safe_load((REPO / profile / "config.yaml").read_text())
    taking = rules_taking_all_cores()
    assert {"build_demo_target", "train_drafter", "vllm_baseline", "evaluate_vllm"} <= taking
    assert taking <= set(settings.get("set-threads", {})), taking - set(settings.get("set-threads", {}))


def test_no_default_profile_applies_itself():
    """Snakemake applies profiles/default to every run, over --profile: there must be none."""
    assert not (REPO / "profiles" / "default").exists()
    assert (REPO / "blackwell").resolve() == REPO / "profiles" / "blackwell"


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_plans_every_job_with_its_gpus(profile, gpu_config, storage):
    output = snakemake(*profile_args(profile, storage), "-n", "-F", "--configfile", "config.yaml", gpu_config,
                       python=python_for(profile))
    assert f"Using profile {profile} for setting default command line arguments" in output
    jobs = planned(output)
    assert {rule for rule, _ in jobs} >= GPU_RULES | CPU_STAGES | {"summary", "export_eagle", "all"}
    # On one machine the generate service leases the GPUs itself and its part jobs hold none.
    expected = EXPECTED_GPUS | ({"generate_part": 0} if profile == "blackwell" else {})
    for rule, resources in jobs:
        if rule in expected:
            assert resources.get("gpu") == str(expected[rule]), (rule, resources)
        else:
            assert resources.get("gpu", "0") == "0", (rule, resources)


def test_blackwell_caps_the_machine_and_cpu_stages_hold_no_gpu(gpu_config):
    """Machine facts come from the profile; what each job needs comes from the config."""
    settings = yaml.safe_load((REPO / "profiles/blackwell/config.yaml").read_text())
    assert settings["executor"] == "local" and settings["resources"] == ["gpu=8"]
    assert settings["rerun-incomplete"] and settings["keep-going"] and settings["retries"] >= 1
    output = snakemake("--profile", "blackwell", "-n", "-F", "--configfile", "config.yaml", gpu_config)
    jobs = dict(planned(output))
    for rule in CPU_STAGES:
        assert "gpu" not in jobs[rule], (rule, jobs[rule])  # not held back while the GPUs are busy
    assert all(int(jobs[rule]["gpu"]) <= 8 for rule in GPU_RULES)


def test_slurm_sends_gpu_jobs_to_gpu_nodes_and_cpu_stages_elsewhere(gpu_config):
    jobs = planned(snakemake("--profile", "profiles/slurm", "-n", "-F", "--configfile", "config.yaml", gpu_config,
                             python=CLUSTER_PYTHON))
    for rule, resources in jobs:
        if rule in GPU_RULES:
            assert resources["slurm_partition"] == "gpu" and resources["gpu_model"] == "rtx_pro_6000", rule
            assert int(resources["cpus_per_gpu"]) > 0 and int(resources["runtime"]) > 0, rule
            assert int(resources["mem_mb"]) >= (64000 if rule in DRAFTER_ONLY else 256000), rule  # a drafter, not the target
        else:
            assert resources["slurm_partition"] == "cpu" and "gpu_model" not in resources, rule
            assert int(resources["runtime"]) > 0 and int(resources["mem_mb"]) > 0, rule


def test_slurm_asks_no_gpu_model_of_a_gpu_rule_the_config_runs_on_cpu():
    """The demo's config extracts on CPU (hidden_states.device cpu: gpu 0): the Snakefile drops the
    shipped profile's gpu_model and cpus_per_gpu from such a rule, else the plugin would ask
    `--gpus=<model>:0` and srun refuse the job (docs/CLUSTERS.md); rules with a GPU keep them."""
    jobs = planned(snakemake("--profile", "profiles/slurm", "-n", "-F", python=CLUSTER_PYTHON))
    on_cpu = {rule for rule, resources in jobs if rule in GPU_RULES and resources.get("gpu") == "0"}
    assert on_cpu >= {"hidden_states", "agreement_states"}
    for rule, resources in jobs:
        if rule in GPU_RULES:
            assert ("gpu_model" in resources) == (rule not in on_cpu), (rule, resources)
            assert ("cpus_per_gpu" in resources) == (rule not in on_cpu), (rule, resources)


def test_kubernetes_gpu_jobs_name_their_manufacturer(gpu_config, storage):
    """The plugin refuses a job with a gpu resource (even 0) and no gpu_manufacturer."""
    output = snakemake(*profile_args("profiles/kubernetes", storage), "-n", "-F", "--configfile", "config.yaml", gpu_config,
                       python=CLUSTER_PYTHON)
    assert "(retrieve from storage)" in output  # inputs come through the storage provider
    for rule, resources in planned(output):
        assert ("gpu" in resources) == ("gpu_manufacturer" in resources) == (rule in GPU_RULES), (rule, resources)
        if rule in GPU_RULES:
            assert resources["gpu_manufacturer"] == "nvidia"


def test_slurm_multi_node_training_builds_one_torchrun_per_node(tmp_path, gpu_config):
    """docs/CLUSTERS.md's edit for 2 nodes x 8 GPUs ("Multi-node training"): the job asks SLURM for 2
    nodes and 16 GPUs, and the training launch made from its resources starts torchrun on each node with srun."""
    settings = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    settings["set-resources"]["train_drafter"] |= {"nodes": 2, "tasks": 2, "tasks_per_gpu": 0, "mpi": "srun"}
    (tmp_path / "slurm2").mkdir()
    (tmp_path / "slurm2/config.yaml").write_text(yaml.safe_dump(settings))
    config = tmp_path / "nodes.yaml"
    config.write_text(yaml.safe_dump({"train": {"num_processes": 16}}))
    output = snakemake("--profile", tmp_path / "slurm2", "-n", "-F", "--configfile", "config.yaml", gpu_config, config,
                       python=CLUSTER_PYTHON)
    train = dict(planned(output))["train_drafter"]
    assert (train["gpu"], train["nodes"], train["tasks"], train["mpi"]) == ("16", "2", "2", "srun")
    command = torchrun_command("args.json", int(train["gpu"]), int(train["nodes"]), train["mpi"], "node1:29500", "42")
    assert command == [
        "srun", sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node1:29500", "--rdzv-id=42", "--nproc-per-node=8", "-m", "eaglenest.train", "args.json",
    ]


def test_torchrun_on_one_node_is_standalone_and_bad_splits_are_refused():
    assert torchrun_command("a.json", 4)[1:] == [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "eaglenest.train", "a.json",
    ]
    with pytest.raises(ValueError, match="num_processes 12 is not a multiple of the 8 nodes"):
        torchrun_command("a.json", 12, 8, "srun")
    with pytest.raises(ValueError, match="2 nodes need a launcher"):
        torchrun_command("a.json", 16, 2)


@pytest.mark.parametrize("profile", PROFILES)
def test_lint_is_clean_with_the_profile(profile, storage):
    output = snakemake(*profile_args(profile, storage), "--lint", python=python_for(profile))
    assert "Congratulations, your workflow is in a good condition!" in output
