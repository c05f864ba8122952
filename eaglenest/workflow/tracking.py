"""Live figures of a stage for experiment trackers: TensorBoard event files, and W&B and MLflow runs
when the config's `tracking` section turns them on (docs/TRAINING.md "Watching training live").

Observability only. Nothing an artifact holds comes from here: the tracking settings are in no
rule's params, this module is plumbing (eaglenest.workflow.fingerprint: editing it rebuilds
nothing), and a tracker that fails, to start or to log (no server, no login, not installed), logs
a warning and is dropped: it never fails the stage. A dropped tracker is closed as failed (an
MLflow run FAILED, a W&B run finished with exit code 1), as are all of them when the stage fails:
no run is left RUNNING. W&B and MLflow (the `trackers` extra) are
imported only when enabled; TensorBoard's writer is torch's (torch.utils.tensorboard)."""

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULTS = {
    "tensorboard": True,
    "wandb": {"enabled": False, "project": "eaglenest", "entity": None, "mode": "online"},
    "mlflow": {"enabled": False, "tracking_uri": None, "experiment": "eaglenest"},
}
# MLflow retries an unreachable server 7 times with a growing backoff (minutes) by default: a tracker
# must not hold a stage up so long. Set in the environment, these win.
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def tracking_settings(section):
    """The config's `tracking` section (absent keys: DEFAULTS)."""
    section = section or {}
    return {
        "tensorboard": section.get("tensorboard", DEFAULTS["tensorboard"]),
        **{name: DEFAULTS[name] | (section.get(name) or {}) for name in ("wandb", "mlflow")},
    }


class TensorBoard:
    """Event files in {folder}/tensorboard/{name}. A rerun that starts at `first_step` (a resumed
    run, or 0 or 1 for a new one) hides the points a run before it wrote from that step on
    (purge_step): TensorBoard shows each step once."""

    def __init__(self, folder, name, first_step, settings):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(Path(folder) / "tensorboard" / name, purge_step=first_step, flush_secs=10)

    def log(self, metrics, step):
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def close(self, failed=False):
        self.writer.close()


class WandB:
    """A W&B run named `name`, its files in {folder}/wandb (mode offline: only there, for `wandb sync`)."""

    def __init__(self, folder, name, first_step, settings):
        import wandb

        s = settings["wandb"]
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=s["project"], entity=s["entity"], mode=s["mode"], name=name, dir=str(folder),
                              settings=wandb.Settings(console="off"))  # the stage's log has its output

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def close(self, failed=False):
        self.run.finish(exit_code=1 if failed else 0)


class MLflow:
    """An MLflow run named `name` in the experiment `mlflow.experiment` at `mlflow.tracking_uri`
    (null: MLflow's own default, e.g. MLFLOW_TRACKING_URI)."""

    def __init__(self, folder, name, first_step, settings):
        for key, value in MLFLOW_HTTP.items():
            os.environ.setdefault(key, value)
        from mlflow import MlflowClient

        s = settings["mlflow"]
        self.client = MlflowClient(tracking_uri=s["tracking_uri"])
        experiment = self.client.get_experiment_by_name(s["experiment"])
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(s["experiment"])
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id

    def log(self, metrics, step):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now, step) for key, value in metrics.items()])

    def close(self, failed=False):
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class Trackers:
    """The stage's trackers that started; each log goes to all of them. One that fails is dropped
    with a warning, and closed as failed."""

    def __init__(self, trackers):
        self.trackers = trackers

    def log(self, metrics, step):
        """Scalars {tag: number} at `step`."""
        for tracker in list(self.trackers):
            try:
                tracker.log(metrics, step)
            except Exception as e:
                self.trackers.remove(tracker)
                log.warning("%s: logging failed, no more figures go to it (the stage goes on): %s: %s",
                            type(tracker).__name__, type(e).__name__, e)
                close_tracker(tracker, failed=True)

    def flush(self):
        """Put TensorBoard's points so far on disk (W&B and MLflow send as they log): a run resumed
        from a checkpoint taken now logs from the step after it, so what came before must be there."""
        for tracker in self.trackers:
            if isinstance(tracker, TensorBoard):
                try:
                    tracker.writer.flush()
                except Exception as e:
                    log.warning("TensorBoard: flushing failed (the stage goes on): %s: %s", type(e).__name__, e)

    def close(self, failed=False):
        """Close every tracker; `failed`: the stage failed, and so does each run."""
        for tracker in self.trackers:
            close_tracker(tracker, failed)


def close_tracker(tracker, failed):
    try:
        tracker.close(failed)
    except Exception as e:
        log.warning("%s: closing failed (the stage goes on): %s: %s", type(tracker).__name__, type(e).__name__, e)


@contextlib.contextmanager
def open_trackers(section, folder, name, first_step=0):
    """Trackers for the stage `name` (the run's name in each), writing under `folder`, as the
    config's `tracking` section says (None: no tracker at all, as in a stage called outside the
    workflow). `first_step`: the first step this process logs (see TensorBoard). The trackers
    are closed on leaving, as failed if the stage raised."""
    enabled = []
    if section is not None:
        settings = tracking_settings(section)
        enabled = [kind for kind, on in ((TensorBoard, settings["tensorboard"]), (WandB, settings["wandb"]["enabled"]),
                                         (MLflow, settings["mlflow"]["enabled"])) if on]
    started = []
    for kind in enabled:
        try:
            started.append(kind(folder, name, first_step, settings))
        except Exception as e:
            log.warning("%s: could not start, the stage goes on without it: %s: %s", kind.__name__, type(e).__name__, e)
    trackers = Trackers(started)
    try:
        yield trackers
    except BaseException:
        trackers.close(failed=True)
        raise
    trackers.close()


def log_acceptance(trackers, runs):
    """Evaluation figures, {tag prefix: acceptance fields (eaglenest.evaluate.acceptance)}: each
    run's mean acceptance length at step 0, its acceptance rate at position k at step k."""
    trackers.log({f"{prefix}/mean_acceptance_length": fields["mean_acceptance_length"]
                  for prefix, fields in runs.items()}, step=0)
    depth = max(len(fields["acceptance_rate_per_position"]) for fields in runs.values())
    for k in range(1, depth + 1):
        trackers.log({f"{prefix}/acceptance": fields["acceptance_rate_per_position"][k - 1]
                      for prefix, fields in runs.items() if len(fields["acceptance_rate_per_position"]) >= k}, step=k)
