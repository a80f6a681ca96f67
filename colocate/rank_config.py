"""A rank's config: the one `colocate train` checked, or one checked once per node.

`colocate train` checks a launch in a child of its own (`launch.start_checks`) while torchrun starts
its ranks, and hands them the resolved config as a file with its SHA-256 beside it (`handover.py`):
a rank waits for it (`await_checked`: a refusal ends the rank quietly), loads it (`load_resolved`)
instead of checking again, and refuses a file that changed. `write_resolved` gives a rank a checked
config with its hash as arguments (`RESOLVED_FLAGS`), for a rank started by other means. Under plain
`torchrun -m colocate.train --config FILE`, local rank 0 of each node checks (its files are the
node's) and the node's other ranks take its resolved config from torchrun's store (`checked_once`).
`configure` is what a rank calls first: its config and the checkpoint to resume, or one line and
exit code 2 before any process group or model.
"""
from __future__ import annotations

import os
import sys
import time

from colocate import handover, run_dir
from colocate.config import Config, ConfigError
from colocate.launch import check_launch, config_from_text, config_text


RESOLVED_FLAGS = ("--resolved-config", "--config-sha256")
"""A checked config given to a rank: its file, and the file's SHA-256. `colocate train` passes the
file alone, before the checks end: the rank waits for it and finds the hash beside it (`handover`)."""


def write_resolved(text: str) -> list[str]:
    """A resolved config in a file of its own -> a rank's arguments naming it and its SHA-256 (a rank
    given a checked config without `colocate train`'s handover: the tests)."""
    import tempfile
    data = text.encode()
    fd, path = tempfile.mkstemp(prefix="colocate-config-", suffix=".yaml")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return [f"{RESOLVED_FLAGS[0]}={path}", f"{RESOLVED_FLAGS[1]}={handover.digest(data)}"]


def resolved_args(argv: list[str]) -> tuple[str, str | None] | None:
    """(file, SHA-256, or None where `colocate train` hands it over with the file) when `argv` names
    a resolved config, else None (a config to check)."""
    given = {name: value for name, _, value in (a.partition("=") for a in argv) if name in RESOLVED_FLAGS}
    if not given:
        return None
    if RESOLVED_FLAGS[0] not in given or len(argv) != len(given):
        raise ConfigError(f"{RESOLVED_FLAGS[0]} (with {RESOLVED_FLAGS[1]}) comes alone (what `colocate train` passes "
                          f"its ranks); got {' '.join(argv)}")
    return given[RESOLVED_FLAGS[0]], given.get(RESOLVED_FLAGS[1])


def await_checked(path: str) -> str:
    """Wait for `colocate train`'s checks (`handover.wait`) -> the checked config's SHA-256; the
    launch's `launch_checked` mark is the handover's time, and the rank's timeline keeps the checks'
    phases (`startup.CHECK_PHASES`) for startup.json. A refusal (the launcher printed why)
    exits quietly with code 2; a launcher gone exits with code 1."""
    from colocate.lifecycle import exit_quietly, launcher_gone
    status = handover.wait(path, handover.launcher(), handover.WAIT_S)
    if status == handover.REFUSED:
        exit_quietly(2)
    if status == handover.GONE:
        launcher_gone(handover.launcher())
    if status == handover.LATE:
        raise ConfigError(f"{RESOLVED_FLAGS[0]}={path}: no checked config came from `colocate train` (its checks ran "
                          "past this rank's wait, `handover.WAIT_S`); start the run again with `colocate train`")
    try:
        record = handover.read_record(path)
    except ValueError as e:
        raise ConfigError(f"{RESOLVED_FLAGS[0]}={path}: its record cannot be read ({e}); start the run again "
                          "with `colocate train`") from None
    from colocate.startup import process_timeline
    timeline = process_timeline()
    timeline.mark("launch_checked", float(record.get("checked_unix", time.time())))
    ends = record.get("phase_ends")
    timeline.checks = {str(k): float(v) for k, v in ends.items()} if isinstance(ends, dict) else {}
    return str(record.get("sha256", ""))


def load_resolved(path: str, sha256: str, world: int) -> Config:
    """The config `colocate train` checked, refused when its file is not the one checked."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"{RESOLVED_FLAGS[0]}={path}: cannot be read ({e.strerror or e}); start the run again "
                          "with `colocate train`") from None
    if handover.digest(data) != sha256:
        raise ConfigError(f"{RESOLVED_FLAGS[0]}={path}: its SHA-256 is {handover.digest(data)[:16]}..., not the "
                          f"{sha256[:16]}... `colocate train` checked (the file changed after the checks); start "
                          "the run again with `colocate train`")
    return config_from_text(data.decode(errors="replace"), f"{RESOLVED_FLAGS[0]}={path}", world)


def load_resumed(cfg: Config) -> dict | None:
    """The checkpoint the checks chose (checkpoint.resume, pinned), loaded without checking again."""
    if not cfg.checkpoint.resume:
        return None
    from colocate.checkpoint import load_checkpoint
    state = load_checkpoint(cfg.checkpoint.resume, cfg.checkpoint.trust_unverified)
    state["path"] = cfg.checkpoint.resume
    return state


REFUSED = "refused"
"""What the checking rank leaves in torchrun's store for its node's other ranks when it refused."""
CHECK_WAIT_S = 3600.0
"""How long a rank waits for its node's checking rank (it is stopped sooner if that rank exits)."""


def node_store():
    """torchrun's store (its agent hosts it), or None where there is none before the process group."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import datetime

    from torch.distributed import TCPStore
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=datetime.timedelta(seconds=CHECK_WAIT_S))


def checked_once(argv: list[str]) -> tuple[Config, dict | None, bool]:
    """Plain torchrun: local rank 0 of each node checks (its files are the node's), the node's other
    ranks take its resolved config from torchrun's store; `--check`, and a rank without that store,
    check for themselves."""
    store = None if "--check" in argv else node_store()
    if store is None:
        return check_launch(argv)
    key = f"colocate/checked-config/node{os.environ.get('GROUP_RANK', '0')}"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            cfg, resume, check_only = check_launch(argv)
        except BaseException:
            store.set(key, REFUSED)
            raise
        store.set(key, config_text(cfg))
        return cfg, resume, check_only
    text = store.get(key).decode()
    if text == REFUSED:  # the checking rank prints why; torchrun reports the exit
        from colocate.lifecycle import exit_quietly
        exit_quietly(2)
    cfg = config_from_text(text, "the config local rank 0 checked", int(os.environ["WORLD_SIZE"]))
    return cfg, load_resumed(cfg), False


def start_config(argv: list[str]) -> tuple[Config, dict | None, bool]:
    """A rank's config: the one `colocate train` checked (waited for, `await_checked`; its hash
    verified), else checked once here (`checked_once`) -> (config, resume state, --check given)."""
    resolved = resolved_args(argv)
    if resolved is None:
        return checked_once(argv)
    path, sha256 = resolved
    cfg = load_resolved(path, sha256 or await_checked(path), world=int(os.environ.get("WORLD_SIZE", "1")))
    if int(os.environ.get("RANK", "0")) == 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        run_dir.hold_in_rank(cfg.metrics.run_dir)  # several nodes: no launcher holds it for the job
    return cfg, load_resumed(cfg), False


OTHER_RANKS_WAIT_S = 60.0  # how long a refusing rank other than 0 waits for the launcher to stop it


def configure(argv: list[str]) -> tuple[Config, dict | None, bool]:
    """A rank's config and the checkpoint to resume (`start_config`: the config `colocate train`
    checked, or one checked once per node under plain torchrun), or one line and exit code 2 before
    any process group or model. A refusing rank other than 0 waits first (rank 0 refuses the same
    input and prints it, and the launcher stops the others); one still alive after
    `OTHER_RANKS_WAIT_S` (its input differs, a file only its node sees; or another node's launcher
    did not stop it) prints its own line."""
    from colocate.checkpoint import CheckpointError
    try:
        if "WORLD_SIZE" not in os.environ and "--check" not in argv:
            raise ConfigError("not started by torchrun: run `colocate train --config FILE [--nproc N]`, or "
                              "`torchrun --nproc-per-node=N -m colocate.train --config FILE` (`--check` only checks)")
        cfg, resume, check_only = start_config(argv)
    except (ConfigError, CheckpointError) as e:
        rank = int(os.environ.get("RANK", "0"))
        # Under torchrun rank 0 refuses the same input and prints it; exiting first would get it killed unheard
        wait_for_rank_0 = rank != 0 and "TORCHELASTIC_RUN_ID" in os.environ and "--check" not in argv
        if wait_for_rank_0:
            time.sleep(OTHER_RANKS_WAIT_S)  # the launcher stops this rank once rank 0 exits
        kind = "config" if isinstance(e, ConfigError) else "checkpoint"
        where = f" (rank {rank}; rank 0 may not have refused it)" if wait_for_rank_0 else ""
        print(f"colocate: {kind} error{where}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    return cfg, resume, check_only


def rank_role(cfg: Config) -> str:
    """This rank's role from the environment alone (also before the topology exists)."""
    from colocate.topology import place_roles
    world = int(os.environ.get("WORLD_SIZE", "1"))
    roles = place_roles(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return roles[int(os.environ.get("RANK", "0"))]
