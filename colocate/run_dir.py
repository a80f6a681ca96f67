"""One run, one directory: `metrics.run_dir` is refused when it already holds a run.

A second run of the same config used to write into the first one's directory: its TensorBoard
events landed beside the old ones (curves on top of each other) and its summary replaced the old
one. The policy (README, "Runs keep their work"):

  * a run directory that holds an earlier run (its `config.yaml`, `tb/`, `summary.json`,
    `adapter/` or `checkpoints/`) is refused, one line, exit code 2, before anything starts;
  * `--resume` (or `checkpoint.resume`) continues the run there from its newest checkpoint, so its
    directory is expected (without a checkpoint it is refused: `checkpoint.resolve_resume`);
  * `--overwrite` deletes what the earlier run wrote there (those entries only; other files stay)
    and starts afresh;
  * or name another directory: `--metrics.run_dir=runs/try-2`.

Checked by `launch.check_config` (every rank, `colocate train` before it starts torchrun); under
torchrun only global rank 0 deletes.
"""
from __future__ import annotations

import os
import shutil

from colocate.config import Config, ConfigError

RUN_ENTRIES = ("config.yaml", "tb", "summary.json", "adapter", "checkpoints", "eval")
"""What a run writes into its directory: any of them marks the directory as taken."""


def split_overwrite(argv: list[str]) -> tuple[list[str], bool]:
    """`--overwrite` out of the arguments -> (the others, given)."""
    rest = [a for a in argv if a != "--overwrite"]
    return rest, len(rest) != len(argv)


def earlier_run(run_dir: str) -> list[str]:
    """The entries of an earlier run found in `run_dir` (empty: the directory is free)."""
    return [e for e in RUN_ENTRIES if os.path.exists(os.path.join(run_dir, e))]


def claim(cfg: Config, *, resume: bool, overwrite: bool, remove: bool) -> None:
    """Refuse a run directory holding an earlier run unless resuming or overwriting; with
    `overwrite` and `remove` (one process of the job) delete the earlier run's entries."""
    found = earlier_run(cfg.metrics.run_dir)
    if not found or resume:
        return
    if not overwrite:
        resumable = "checkpoints" in found and any(os.scandir(os.path.join(cfg.metrics.run_dir, "checkpoints")))
        how = ("pass --resume to continue it, --overwrite to replace it" if resumable else
               "it wrote no checkpoint to --resume from: pass --overwrite to replace it")
        raise ConfigError(f"metrics.run_dir={cfg.metrics.run_dir!r} holds an earlier run ({', '.join(found)}): "
                          f"{how}, or --metrics.run_dir=NEW")
    if remove:
        for entry in found:
            path = os.path.join(cfg.metrics.run_dir, entry)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
