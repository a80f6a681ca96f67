"""metrics.loggers: W&B, MLflow and trackio get the learner's scalars through `MetricsWriter`
(the same call TensorBoard's events come from), the resolved config and the run name; each is read
back offline (W&B offline mode's run summary, an MLflow local file store, trackio's local database).
A package that is not installed skips its case; CI installs the [trackers] extra at the versions in constraints.txt."""
import glob
import json
import os
import sqlite3
import sys

import pytest

from colocate.config import ConfigError, load_config
from colocate.metrics import MetricsWriter
from colocate.trackers import check_loggers, open_trackers
from tests.conftest import REPO

REWARDS = [0.125, 0.5, 0.875]


def log_run(logger: str, tmp_path):
    cfg = load_config(os.path.join(REPO, "configs", "cpu-tiny.yaml"),
                      {"metrics": {"loggers": f"tensorboard,{logger}", "run_dir": str(tmp_path / "my-run")}})
    writer = MetricsWriter(cfg.metrics.run_dir, "learner", enabled=True, tensorboard=False)
    writer.trackers = open_trackers(cfg)
    for step, reward in enumerate(REWARDS):
        writer.scalars("learner", {"reward": reward}, step)
    writer.close()
    return cfg


def test_wandb_offline(tmp_path, monkeypatch):
    """W&B's offline run file (`run-*.wandb`, the records `wandb sync` would upload) holds the run
    name, every logged scalar under its name and the resolved config: read back as bytes, since
    wandb-core's record format has no Python reader."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_run("wandb", tmp_path)
    run, = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = open(run, "rb").read()
    assert b"my-run" in records and b"micro_batch_tokens" in records
    assert records.count(b"learner/reward") >= len(REWARDS)
    assert all(repr(r).encode() in records for r in REWARDS)  # value_json of each logged value


def test_mlflow_local_file_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store only on request
    log_run("mlflow", tmp_path)
    client = mlflow.tracking.MlflowClient()
    run, = client.search_runs([client.get_experiment_by_name("colocate").experiment_id])
    assert run.info.run_name == "my-run"
    history = client.get_metric_history(run.info.run_id, "learner/reward")
    assert [(m.step, m.value) for m in history] == list(enumerate(REWARDS))
    config = open(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read()
    assert "micro_batch_tokens" in config


def test_trackio_local(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    for name in [m for m in sys.modules if m == "trackio" or m.startswith("trackio.")]:
        monkeypatch.delitem(sys.modules, name)
    pytest.importorskip("trackio")
    log_run("trackio", tmp_path)
    databases = glob.glob(str(tmp_path / "trackio" / "**" / "*.db"), recursive=True)
    assert databases
    rows = []
    for db in databases:
        with sqlite3.connect(db) as con:
            tables = [t for (t,) in con.execute("select name from sqlite_master where type='table'")]
            for table in tables:
                rows += [str(r) for r in con.execute(f"select * from {table}")]
    logged = [r for r in rows if "learner/reward" in r]
    assert len(logged) == len(REWARDS) and "my-run" in logged[0], rows[:5]


def test_a_missing_tracker_package_is_a_config_error(monkeypatch):
    import importlib.util
    cfg = load_config(os.path.join(REPO, "configs", "cpu-tiny.yaml"), {"metrics": {"loggers": "[tensorboard,wandb]"}})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="metrics.loggers names 'wandb' but the wandb package is not installed"):
        check_loggers(cfg)
    with pytest.raises(ConfigError, match="metrics.loggers: 'neptune' is not one of"):
        load_config(None, {"metrics": {"loggers": "neptune"}})


def test_every_tracker_holds_every_step_of_a_run_with_the_canary_on(learning_run, monkeypatch):
    """A real run (tests/conftest.py's `learning_run`: the canary at every version, every installed
    tracker offline): each tracker's own record holds the learner's reward at every step and the
    canary's scalars. A scalar logged ahead of its step made W&B drop every later, smaller step."""
    from tests.conftest import LEARNING_STEPS
    root = learning_run.run_dir.parent / "trackers"
    checked = 0
    if glob.glob(str(root / "wandb" / "offline-run-*")):
        run, = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
        records = open(run, "rb").read()
        assert records.count(b"learner/reward") >= LEARNING_STEPS and b"sync/canary_gap" in records
        assert b"less than the current step" not in (learning_run.stdout + learning_run.stderr).encode()
        checked += 1
    if (root / "mlruns").exists():
        import mlflow
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads the file store only on request
        client = mlflow.tracking.MlflowClient(tracking_uri=(root / "mlruns").as_uri())
        run, = client.search_runs([client.get_experiment_by_name("colocate").experiment_id])
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "learner/reward")]
        assert sorted(steps) == list(range(LEARNING_STEPS))
        assert client.get_metric_history(run.info.run_id, "sync/canary_gap")
        checked += 1
    databases = glob.glob(str(root / "trackio" / "**" / "*.db"), recursive=True)
    if databases:
        rows = []
        for db in databases:
            with sqlite3.connect(db) as con:
                for (table,) in con.execute("select name from sqlite_master where type='table'").fetchall():
                    rows += [str(r) for r in con.execute(f"select * from {table}")]
        assert len([r for r in rows if "learner/reward" in r]) == LEARNING_STEPS
        checked += 1
    if not checked:
        pytest.skip("no tracker package installed (pip install -e \".[trackers]\")")


def test_the_system_sampler_keeps_its_seconds_out_of_the_trackers(tmp_path):
    """The system sampler indexes its scalars by seconds: on a run slower than a step a second those
    pass the training steps, and W&B then drops every later step's scalars. It writes TensorBoard
    only; the learner's scalars reach the trackers at their steps, in order."""
    import time

    from colocate.metrics import SystemSampler

    class Tracker:
        def __init__(self):
            self.steps = []

        def log(self, values, step):
            self.steps.append((sorted(values), step))

    writer = MetricsWriter(str(tmp_path), "learner", enabled=True, tensorboard=False)
    writer.trackers = [tracker := Tracker()]
    sampler = SystemSampler(writer, 0.01, None)
    sampler._t0 -= 1000  # as late in a slow run
    sampler.start()
    for step in range(3):
        writer.scalars("learner", {"reward": 0.5}, step)
        time.sleep(0.05)
    sampler.halted.set()
    sampler.join()
    assert sampler.samples > 0 and tracker.steps == [(["learner/reward"], s) for s in range(3)]
