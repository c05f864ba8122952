"""README's Kimi-K2.5 example ("Your own target"), exactly as printed: it validates against the
schema and dry-runs with the blackwell profile against a tiny target packaged as Kimi ships
(wrapper config, sharded prefixed weights, remote-code tiktoken tokenizer)."""

import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, merge
from eaglenest.workflow.config import validate_config
from kimi_target import build_kimi_target

TP = 8


def readme_kimi_yaml():
    """The first YAML block of README's "Your own target" section."""
    section = (REPO / "README.md").read_text().split("\n## Your own target\n", 1)[1].split("\n## ", 1)[0]
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S)[1])


def test_the_example_is_complete_and_valid():
    example = readme_kimi_yaml()
    config = merge(yaml.safe_load((REPO / "config.yaml").read_text()), example)  # as --configfile does
    validate_config(config, REPO / "schemas/config.schema.yaml")
    assert example["target"] == {"demo": False, "path": example["target"]["path"], "trust_remote_code": True}
    assert example["hidden_states"]["backend"] == "vllm" and example["vllm"]["tensor_parallel_size"] == TP
    assert example["vllm"]["attention_backend"] == "TRITON_MLA"
    assert example["tokenize"]["max_seq_len"] >= 8192  # long reasoning: samples average ~2,100 tokens
    assert example["tokenize"]["max_seq_len"] <= example["vllm"]["max_model_len"]  # extraction takes them whole
    assert example["hidden_states"]["dtype"] == "float8_e4m3fn" and example["vllm"]["dtype"] == "auto"
    assert example["drafter"]["layer"] == "mla"  # the layer that starts beside TRITON_MLA (docs/CONTAINER.md)
    grid = example["eval"]
    assert 1.0 in grid["temperatures"] and 0.0 in grid["temperatures"]  # the thinking mode as served, and greedy
    assert len(grid["suites"]) >= 4 and len(grid["num_speculative_tokens"]) >= 3 and len(grid["concurrency"]) >= 2
    assert grid["draft_sample_methods"] == ["greedy", "probabilistic"]  # served at 1.0: the method is measured too


@pytest.fixture(scope="module")
def kimi_run(tmp_path_factory):
    """The README example pointed at a tiny Kimi-packaged target and local prompts."""
    tmp = tmp_path_factory.mktemp("kimi_example")
    build_kimi_target(tmp / "Kimi-K2.5", tokenizer=True)
    example = readme_kimi_yaml()
    example["target"]["path"] = str(tmp / "Kimi-K2.5")
    example["data"]["prompts"] = str(REPO / "resources/demo/prompts.jsonl")
    for suite in example["eval"]["suites"]:
        suite["prompts"] = str(REPO / "resources/demo/eval_chat.jsonl")
    example["results"] = str(tmp / "results")
    path = tmp / "kimi.yaml"
    path.write_text(yaml.safe_dump(example))
    return path


def test_the_example_dry_runs_with_the_blackwell_profile(kimi_run):
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--profile", "blackwell", "-n", "--configfile", kimi_run],
        cwd=REPO, capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", output.split("Job stats:", 1)[1], re.M))
    assert "build_demo_target" not in counts
    assert counts["generate_part"] == "16" and counts["generate_responses"] == "1"  # generate.num_parts
    assert counts["hidden_states"] == "256" and counts["train_drafter"] == "1"
    assert counts["eval_prompts"] == "5" and counts["vllm_baseline"] == "1" and counts["vllm_speculative"] == "6"  # greedy and probabilistic, K 1, 3, 5
    jobs = re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):\n((?:[ \t]+.*\n?)*)", output, re.M)
    gpus = {rule: re.search(r"\bgpu=(\d+)", body)[1] for rule, body in jobs if re.search(r"\bgpu=(\d+)", body)}
    assert gpus["hidden_states"] == gpus["vllm_baseline"] == gpus["vllm_speculative"] == str(TP)
    assert gpus["generate_part"] == "0"  # the generate service leases the engine's GPUs, its part jobs none
    assert gpus["agreement_states"] == str(TP) and gpus["evaluate_vllm"] == "1"  # the target's states, then the drafter alone
    assert gpus["train_drafter"] == str(TP)
