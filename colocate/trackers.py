"""Experiment trackers beside TensorBoard: W&B, MLflow and trackio (`metrics.loggers`).

Each gets the same scalars as TensorBoard (`MetricsWriter.scalars` forwards them, namespaced
`learner/...`, `rollout/...`), the resolved config and the run name (the run directory's base
name), from learner rank 0 only: one run per job in the tracker. Each is an optional package
(`pip install -e ".[trackers]"`); a logger named in the config whose package is missing is a
config error before launch (`check_loggers`, from the launch checks: `launch.check_parsed`).

Where they write is theirs to decide, through their own environment variables: `WANDB_MODE=offline`
(and `WANDB_DIR`) keeps W&B on disk, `MLFLOW_TRACKING_URI` picks MLflow's store (a local file
store such as `./mlruns` also needs `MLFLOW_ALLOW_FILE_STORE=true` from MLflow 3 on), `TRACKIO_DIR`
trackio's local database. Nothing here touches the network unless those say so.
"""
from __future__ import annotations

import importlib.util
import os

from colocate.config import Config, ConfigError, to_dict

PACKAGES = {"wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
"""logger name -> the module it needs (tensorboard comes with torch)."""


def run_name(cfg: Config) -> str:
    return os.path.basename(os.path.normpath(cfg.metrics.run_dir))


def check_loggers(cfg: Config) -> None:
    """Every logger named in metrics.loggers can be imported (one line before launch, not a crash
    on learner rank 0 after the model is built)."""
    for name in cfg.metrics.loggers:
        module = PACKAGES.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(f"metrics.loggers names {name!r} but the {module} package is not installed "
                              f"(pip install -e \".[trackers]\", or pip install {module})")


class WandbTracker:
    def __init__(self, cfg: Config):
        import wandb
        self.run = wandb.init(project=cfg.metrics.project, name=run_name(cfg), config=to_dict(cfg),
                              dir=os.environ.get("WANDB_DIR") or None)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        """The run finished, then W&B's service torn down: `finish` only tells the service, which
        writes the run's records (the offline `.wandb` file, the uploads) after it returns; `teardown`
        waits for them, since a rank ends without the interpreter's `atexit` hooks that would."""
        import wandb
        self.run.finish()
        wandb.teardown()


class MlflowTracker:
    def __init__(self, cfg: Config):
        import mlflow
        self.mlflow = mlflow
        mlflow.set_experiment(cfg.metrics.project)
        self.run = mlflow.start_run(run_name=run_name(cfg))
        mlflow.log_dict(to_dict(cfg), "config.yaml")  # the whole config (params cap values at 6000 chars)

    def log(self, values: dict[str, float], step: int) -> None:
        # by run id: MLflow's active run is per thread, and the system sampler logs from its own
        self.mlflow.log_metrics(values, step=step, run_id=self.run.info.run_id)

    def close(self) -> None:
        self.mlflow.end_run()


class TrackioTracker:
    def __init__(self, cfg: Config):
        import trackio
        self.run = trackio.init(project=cfg.metrics.project, name=run_name(cfg), config=to_dict(cfg))

    def log(self, values: dict[str, float], step: int) -> None:
        # the run's own method: trackio.log finds the run through a context variable set by init,
        # which the system sampler's thread does not see
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker, "trackio": TrackioTracker}


def open_trackers(cfg: Config) -> list:
    """One open run per logger of metrics.loggers other than tensorboard (MetricsWriter's own)."""
    return [TRACKERS[name](cfg) for name in cfg.metrics.loggers if name in TRACKERS]
