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

Checked once per launch (`launch.check_parsed`: `colocate train`'s checking child, or one rank per
node under plain torchrun); only that one process deletes.

Two runs never share a directory: a live run holds an exclusive `flock` on `<run_dir>/.colocate-lock`
(`colocate train` on one node for its whole life, else the job's global rank 0), which records who
holds it. Another run, a `colocate check` or an `--overwrite` into that directory is refused in one
line naming the holder (pid, host, start time). The kernel drops the lock when its process ends,
however it ends (kill -9, the out-of-memory killer): a dead run never leaves it stuck.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time

from colocate.config import Config, ConfigError

RUN_ENTRIES = ("config.yaml", "tb", "summary.json", "adapter", "checkpoints", "eval", "startup.json",
               "memory_plan.json", "inference-rank*.json", "failure-rank*.txt")
"""What a run writes into its directory (names, or glob patterns for its per-rank files): any of them
marks the directory as taken, and `--overwrite` deletes them all. `colocate eval`'s `evals/` is no
run entry: an evaluation of the base model may come before the run."""


def split_overwrite(argv: list[str]) -> tuple[list[str], bool]:
    """`--overwrite` out of the arguments -> (the others, given)."""
    rest = [a for a in argv if a != "--overwrite"]
    return rest, len(rest) != len(argv)


def earlier_run(run_dir: str) -> list[str]:
    """The entries of an earlier run found in `run_dir` (empty: the directory is free)."""
    import glob
    return [os.path.relpath(path, run_dir) for entry in RUN_ENTRIES
            for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), entry)))]


LOCK = ".colocate-lock"
"""The file whose `flock` a live run holds; it stays when the run ends (unlocked) and is no run entry."""

_held: list = []
"""Rank 0's open lock file: kept open for the process's life (nothing in the rank would hold it)."""


def in_use(run_dir: str, holder: dict) -> ConfigError:
    """The refusal naming the live run by its record (empty: it is still writing it)."""
    started = holder.get("started", "?")
    who = (f"pid {holder.get('pid', '?')} ({holder.get('by', 'a run')}) on {holder.get('host', '?')}, started {started}"
           if holder else "a run that is starting")
    return ConfigError(f"metrics.run_dir={run_dir!r} is in use by {who}: wait for it to end or stop it, or "
                       f"--metrics.run_dir=NEW")


def read_holder(f) -> dict:
    """The holder's record (empty while the holder is writing it)."""
    f.seek(0)
    try:
        record = json.loads(f.read() or "{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


_held_paths: dict = {}
"""The run directories this process holds -> its pid; a child it forks (the launcher's checks)
inherits the record, and with it the knowledge that its parent is the holder (whatever user code
did to json meanwhile)."""


def held_by_parent(holder: dict) -> bool:
    """Whether the lock's holder is this process's parent (`colocate train`, whose checking child
    and ranks run under its lock)."""
    return holder.get("pid") == os.getppid() and holder.get("host") == socket.gethostname()


def refuse_if_held(run_dir: str) -> None:
    """ConfigError when a live run other than this process's launcher holds `run_dir`; takes
    nothing (`colocate check`, the launcher's checking child)."""
    if _held_paths.get(os.path.realpath(run_dir)) == os.getppid():  # this process's launcher holds it
        return
    try:
        f = open(os.path.join(run_dir, LOCK))
    except OSError:  # no lock file (a new directory), or none readable: no live run recorded one
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(f)
            if not held_by_parent(holder):
                raise in_use(run_dir, holder) from None
        except OSError:  # a filesystem without locks (some network mounts): the earlier-run check remains
            return


def hold(run_dir: str, by: str):
    """Lock `run_dir` -> the open lock file (the lock lasts until it is closed), or None when this
    rank's launcher (its parent, `colocate train`) holds it or the filesystem has no locks;
    ConfigError naming the live run that holds it."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        f = open(os.path.join(run_dir, LOCK), "a+")  # not written atomically: the lock is on this very inode
    except OSError:  # a directory that cannot be made: the checks refuse it in their own line (preflight)
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = read_holder(f)
        f.close()
        if held_by_parent(holder):
            return None
        raise in_use(run_dir, holder) from None
    except OSError:  # a filesystem without locks: the earlier-run check remains
        f.close()
        return None
    _held_paths[os.path.realpath(run_dir)] = os.getpid()
    f.truncate(0)
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "by": by,
                        "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
    f.flush()
    return f


def hold_in_rank(run_dir: str) -> None:
    """Global rank 0 of a torchrun job holds `run_dir` for its life, unless its launcher
    (`colocate train` on one node) does; a job on several nodes is held here."""
    lock = hold(run_dir, by="rank 0 of a torchrun job")
    if lock is not None:
        _held.append(lock)


def claim(cfg: Config, *, resume: bool, overwrite: bool, remove: bool) -> None:
    """Refuse a run directory a live run holds (global rank 0 under torchrun takes the lock, its
    launcher and `colocate check` look), then one holding an earlier run unless resuming or
    overwriting; with `overwrite` and `remove` (one process of the job) delete the earlier run's
    entries."""
    if remove and "TORCHELASTIC_RUN_ID" in os.environ:
        hold_in_rank(cfg.metrics.run_dir)
    elif int(os.environ.get("RANK", "0")) == 0:
        refuse_if_held(cfg.metrics.run_dir)
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
