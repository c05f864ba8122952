"""Live tracking (eaglenest.workflow.tracking): real trainings on the tiny Llama's shards of
test_train log every optimizer step to TensorBoard, to an MLflow file store and to an offline W&B
run, each read back by its own reader and held against train_log.tsv; offline evaluation's
acceptance goes to TensorBoard; an unreachable MLflow server only warns."""

import json
import logging
import struct

import pytest
import yaml

from conftest import REPO, assert_tracked_as_logged, tensorboard_scalars
from eaglenest.evaluate.offline import evaluate_offline
from eaglenest.train.loop import train_drafter
from eaglenest.workflow.tracking import DEFAULTS, open_trackers
from test_train import HELDOUT, K, data, train_args  # noqa: F401 (data: the shards' fixture)

STEPS = 12


def train_tracked(data, folder, tracking, **kwargs):
    """train_drafter for STEPS steps, a log row per step, its drafter and log (and so its event files) in `folder`."""
    root, shards = data
    positional, args = train_args(root, shards, "tracked", max_steps=STEPS, log_every=1, **kwargs)
    positional[5:7] = [folder / "drafter", folder / "train_log.tsv"]
    train_drafter(*positional, **args, tracking=tracking)
    return folder


@pytest.fixture(scope="module")
def tracked(data, tmp_path_factory):
    """One training with every tracker on: TensorBoard, MLflow in a file store, W&B offline."""
    folder = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.18 refuses a file store without it
        env.setenv("WANDB_SILENT", "true")
        train_tracked(data, folder, {
            "wandb": {"enabled": True, "mode": "offline", "project": "test"},
            "mlflow": {"enabled": True, "tracking_uri": f"file:{folder}/mlruns", "experiment": "test"},
        })
    return folder


def test_training_writes_each_optimizer_step_to_tensorboard_as_its_log_says(tracked):
    """Read back with TensorBoard's own reader: one point per step of each TSV figure, lr and tokens/s, equal to the log's rows."""
    scalars = tensorboard_scalars(tracked / "tensorboard" / "train_drafter")
    assert {f"train/acc_{k}" for k in range(K)} | {"train/loss", "train/grad_norm", "train/lr"} <= set(scalars)
    assert_tracked_as_logged(scalars, tracked / "train_log.tsv")


def test_mlflow_gets_every_step_in_a_file_store(tracked):
    """The run, named after the stage, in the configured experiment of the file store; its metric histories are the log's."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{tracked}/mlruns")
    [run] = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert run.info.run_name == "train_drafter" and run.info.status == "FINISHED"
    scalars = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
               for key in run.data.metrics}
    assert_tracked_as_logged(scalars, tracked / "train_log.tsv")


def wandb_records(path):
    """The records of a W&B run file (run-*.wandb), W&B's own protobuf: its record log is a
    7-byte header, then 32 KiB blocks of chunks (crc32 4 bytes, length 2, type 1, where type 1 is
    a whole record, 2-4 its first, middle and last chunks)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, record = 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            break
        record += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            yield Record.FromString(record)
            record = b""


def wandb_history(path):
    """{key: [(step, value)]} of the history records in a W&B run file."""
    history = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)  # W&B splits "train/loss" into a nested key
                if not key.startswith("_"):  # _step, _runtime, _timestamp: W&B's own
                    history.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return history


def test_wandb_offline_keeps_every_step_in_its_run_file(tracked):
    """The offline run's files under the training's folder, its history (read from the run file) the log's."""
    [run_file] = (tracked / "wandb").glob("offline-run-*/run-*.wandb")
    assert_tracked_as_logged(wandb_history(run_file), tracked / "train_log.tsv")


def test_an_unreachable_mlflow_server_warns_and_training_completes(data, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="eaglenest.workflow.tracking"):
        folder = train_tracked(data, tmp_path, {"tensorboard": False, "mlflow": {
            "enabled": True, "tracking_uri": "http://127.0.0.1:9", "experiment": "unreachable"}})
    assert "MLflow: could not start, the stage goes on without it" in caplog.text
    assert (folder / "drafter" / "model.safetensors").is_file()
    assert len((folder / "train_log.tsv").read_text().splitlines()) == 1 + STEPS
    assert not (folder / "tensorboard").exists()  # tensorboard: false


def test_a_tracker_dropped_after_an_error_and_the_trackers_of_a_failed_stage_end_their_runs_failed(tmp_path, monkeypatch):
    """MLflow refuses a metric's name: its run is ended FAILED at once, while the stage goes on. A
    stage that raises ends its MLflow run FAILED and its W&B run with exit code 1 (none left RUNNING)."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_SILENT", "true")
    client = MlflowClient(tracking_uri=f"file:{tmp_path}/mlruns")
    mlflow = {"enabled": True, "tracking_uri": f"file:{tmp_path}/mlruns", "experiment": "test"}

    def status(name):
        [run] = client.search_runs([client.get_experiment_by_name("test").experiment_id],
                                   filter_string=f"attributes.run_name = '{name}'")
        return run.info.status

    with open_trackers({"tensorboard": False, "mlflow": mlflow}, tmp_path / "dropped", "dropped") as trackers:
        trackers.log({"loss": 1.0}, step=1)
        assert status("dropped") == "RUNNING"
        trackers.log({"bad*name": 1.0}, step=2)  # Names may only contain alphanumerics, ...
        assert trackers.trackers == [] and status("dropped") == "FAILED"
    with pytest.raises(RuntimeError, match="the stage failed"):
        with open_trackers({"tensorboard": False, "mlflow": mlflow, "wandb": {"enabled": True, "mode": "offline",
                                                                              "project": "test"}},
                           tmp_path / "failed", "failed") as trackers:
            trackers.log({"loss": 1.0}, step=1)
            raise RuntimeError("the stage failed")
    assert status("failed") == "FAILED"
    [run_file] = (tmp_path / "failed/wandb").glob("offline-run-*/run-*.wandb")
    assert [r.exit.exit_code for r in wandb_records(run_file) if r.WhichOneof("record_type") == "exit"] == [1]


def test_without_tracking_nothing_is_written_beside_the_log(data, tmp_path):
    """tracking=None, a stage called outside the workflow: no tracker, no folder."""
    train_tracked(data, tmp_path, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "train_log.tsv"]


def test_offline_evaluation_writes_its_acceptance_per_position_to_tensorboard(data, tracked, tmp_path):
    """Every anchor's and the served acceptance at each position k as step k, their mean acceptance length at step 0."""
    root, shards = data
    result = evaluate_offline(shards, root / "manifest.json", tracked / "drafter", root / "target",
                              tmp_path / "offline_metrics.json", heldout_fraction=HELDOUT, num_speculative_tokens=K,
                              tracking={})
    scalars = tensorboard_scalars(tmp_path / "tensorboard" / "evaluate_offline")
    for name, fields in (("every_anchor", result), ("served", result["served"])):
        prefix = f"offline/heldout/K{K}/{name}"
        assert scalars[f"{prefix}/mean_acceptance_length"] == [(0, pytest.approx(fields["mean_acceptance_length"]))]
        assert scalars[f"{prefix}/acceptance"] == [
            (k, pytest.approx(rate)) for k, rate in enumerate(fields["acceptance_rate_per_position"], 1)]
    assert len(scalars) == 4


def test_the_schema_defaults_are_the_trackers_defaults():
    """A config without a tracking section (or with part of one) runs with what the schema documents."""
    schema = yaml.safe_load((REPO / "schemas/config.schema.yaml").read_text())["properties"]["tracking"]["properties"]
    documented = {name: spec["default"] if "default" in spec else
                  {key: value["default"] for key, value in spec["properties"].items()} for name, spec in schema.items()}
    assert documented == DEFAULTS
    assert yaml.safe_load((REPO / "config.yaml").read_text())["tracking"] == DEFAULTS
