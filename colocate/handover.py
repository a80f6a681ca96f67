"""How `colocate train` hands its ranks the config it checked, while they start.

`colocate train` starts torchrun as soon as the config is parsed, beside the forked child that
checks it: the ranks import their modules meanwhile. Each rank gets `--resolved-config=PATH` for a
file that does not exist yet, in a private directory the launcher made (`place`), and waits for it
(`wait`) before it does anything else. When the checks pass the launcher writes the config's record
(its SHA-256, the time of the handover, the ends of the checks' phases: `startup.CHECK_PHASES`) and
then renames the config into place (`hand_over`): a rank that sees the config finds the record
beside it, and refuses a config that changed after the checks. When they refuse, the launcher
leaves a refusal marker instead (`refuse`): every waiting rank exits quietly with code 2, the
launcher with the check's code and its one line. A rank watches for the refusal from its first line
(`watch`), so a refused launch does not wait for its imports.

Standard library only, and of colocate only `jsonfile` (standard library too): a rank imports this
first, before its own imports.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time

from colocate.jsonfile import read_object, write_atomic

LAUNCHER_ENV = "COLOCATE_LAUNCHER_PID"
"""The launcher's pid, for its ranks: a rank waits only while this process is its parent."""
ENGINE_IMPORTS_ENV = "COLOCATE_ENGINE_IMPORTS"
"""The launcher's word to its ranks, from the config it parsed (`engine.table.preimport_ranks`, an
`engine.headstart.EngineWord`): which ones will build which engine, so that they import its modules
while they wait (`engine.table.preimport`), and the GPU of the server each starts first (`head_start`)."""
RECORD, REFUSAL = ".record.json", ".refused"
"""Beside the config: its record (`hand_over`), or the refusal marker (`refuse`)."""
POLL_S = 0.02
"""How often a waiting rank looks: a refused launch ends within this of the refusal."""
WAIT_S = 3600.0
"""The longest a rank waits for the checks (they may download the model)."""
READY, REFUSED, GONE, LATE = "ready", "refused", "gone", "late"
"""How a wait ended (`wait`)."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def place() -> str:
    """A private directory for one launch (mode 0700) -> the path its ranks wait on."""
    return os.path.join(tempfile.mkdtemp(prefix="colocate-launch-"), "config.yaml")


def hand_over(path: str, text: str, phase_ends: dict[str, float] | None = None) -> None:
    """The checked config's record (with `phase_ends`, the checks' phases, unix seconds, in order),
    then the config at `path`, each renamed into place: a rank that sees the config finds the record."""
    data = text.encode()
    write_atomic(path + RECORD, {"sha256": digest(data), "checked_unix": time.time(), "phase_ends": phase_ends or {}})
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def refuse(path: str) -> None:
    """The checks refused: the ranks waiting on `path` exit (code 2, quietly)."""
    with open(path + REFUSAL, "w"):
        pass


def remove(path: str) -> None:
    """The launch's private directory, once its ranks have ended."""
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def read_record(path: str) -> dict:
    """The record `hand_over` wrote beside `path` (raises ValueError: missing, corrupt, not an object)."""
    return read_object(path + RECORD)


def launcher() -> int:
    """The pid of the launcher that started this rank (its parent)."""
    return int(os.environ.get(LAUNCHER_ENV) or os.getppid())


def wait(path: str, parent: int, wait_s: float = WAIT_S) -> str:
    """Wait for the launcher's word on `path` -> READY (the config is there), REFUSED, GONE (the
    launcher, `parent`, is no longer this process's parent: it ended, nothing will come) or LATE
    (none after `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        if os.path.exists(path):
            return READY
        if os.path.exists(path + REFUSAL):
            return REFUSED
        if os.getppid() != parent:
            return GONE
        if time.monotonic() > deadline:
            return LATE
        time.sleep(POLL_S)


def watch(argv: list[str]) -> None:
    """A rank of `colocate train` (`argv` is `--resolved-config=PATH` alone): a thread that ends the
    rank quietly with code 2 as soon as the checks refuse, also in the middle of its imports; it
    stops once the config is there (the rank's own `wait` takes it from there)."""
    if len(argv) == 1 and argv[0].startswith("--resolved-config="):
        threading.Thread(target=_end_on_refusal, args=(argv[0].partition("=")[2], launcher()),
                         name="colocate-handover", daemon=True).start()


def _end_on_refusal(path: str, parent: int) -> None:
    if wait(path, parent) == REFUSED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
