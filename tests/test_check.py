"""The pre-flight check refuses each silent mismatch with a message that names the cause."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.drafter.check import check_drafter
from eaglenest.workflow.errors import InputError


@pytest.fixture
def paths(built, tmp_path, monkeypatch):
    """The built run's artifacts as the rule sees them (relative to the workflow folder), with a
    private copy of the drafter to break."""
    monkeypatch.chdir(built)
    results = built / "results"
    drafter = tmp_path / "drafter"
    shutil.copytree(results / "drafter", drafter)
    return {
        "drafter_dir": drafter,
        "trained_config_path": results / "train/drafter_config.json",
        "manifest_path": results / "hidden_states/manifest.json",
        "d2t_path": results / "vocab/d2t.pt",
        "t2d_path": results / "vocab/t2d.pt",
        "target_dir": "results/target",
        "out_path": tmp_path / "check.json",
    }


def edit_config(drafter, change):
    path = drafter / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def edit_weights(drafter, change):
    path = drafter / "model.safetensors"
    weights = load_file(str(path))
    change(weights)
    save_file(weights, str(path))


def test_the_trained_drafter_passes(paths):
    check_drafter(**paths)
    assert json.loads(paths["out_path"].read_text())["ok"] is True


def shift_layer_ids(config):
    config["eagle_aux_hidden_state_layer_ids"] = [k - 1 for k in config["eagle_aux_hidden_state_layer_ids"]]


def drop(flag):
    def change(config):
        del config[flag]
    return change


def flip(flag):
    def change(config):
        config[flag] = not config[flag]
    return change


def other_verifier(config):
    config["speculators_config"]["verifier"]["name_or_path"] = "/models/another-target"


@pytest.mark.parametrize(
    "change, cause",
    [
        (shift_layer_ids, "differ from the hidden states' .* SGLang's ids are one lower"),
        (drop("norm_before_residual"), "norm_before_residual is not written .*its default, True"),
        (drop("norm_before_fc"), "norm_before_fc is not written"),
        (drop("norm_output"), "norm_output is not written"),
        (flip("norm_before_residual"), "norm_before_residual is (True|False) in config.json, training used (False|True)"),
        # on: no input_norm weights to read; off: the trained ones are left out
        (flip("norm_before_fc"), "norm_before_fc is (true but input_norm.weight is not|False in config.json, training used True)"),
        (flip("norm_output"), "norm_output is (True|False) in config.json, training used (False|True)"),
        (other_verifier, "the config names verifier '/models/another-target', not the target"),
    ],
)
def test_config_mismatches_are_refused(paths, change, cause):
    edit_config(paths["drafter_dir"], change)
    with pytest.raises(InputError, match=cause):
        check_drafter(**paths)
    assert not paths["out_path"].exists()


def absolute_d2t(weights):
    weights["d2t"] = torch.arange(len(weights["d2t"])) + weights["d2t"]


def nan_weight(weights):
    weights["fc.weight"][0, 0] = float("nan")


@pytest.mark.parametrize(
    "change, cause",
    [
        (absolute_d2t, "d2t holds absolute target ids, not offsets"),
        (nan_weight, r"non-finite weights in \['fc.weight'\]"),
    ],
)
def test_weight_mismatches_are_refused(paths, change, cause):
    edit_weights(paths["drafter_dir"], change)
    with pytest.raises(InputError, match=cause):
        check_drafter(**paths)


def test_a_stale_vocab_is_refused(paths, tmp_path):
    t2d = torch.load(paths["t2d_path"])
    ids = t2d.nonzero().flatten()
    ids[-1] = int((~t2d).nonzero().flatten()[-1])  # swap the last draft token for an unused one
    ids = ids.sort().values
    moved = torch.zeros_like(t2d)
    moved[ids] = True
    torch.save(ids - torch.arange(len(ids)), tmp_path / "d2t.pt")
    torch.save(moved, tmp_path / "t2d.pt")
    with pytest.raises(InputError, match=r"differ from the current draft vocab \(stale drafter\)"):
        check_drafter(**paths | {"d2t_path": tmp_path / "d2t.pt", "t2d_path": tmp_path / "t2d.pt"})
