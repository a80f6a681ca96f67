"""A rank's config: the one `colocate train` checked, or one checked once per node.

`colocate train` checks a launch in its own process (`launch.check_in_child`) and hands its ranks
the resolved config as a file and the file's SHA-256 (`write_resolved`, `RESOLVED_FLAGS`): a rank
loads it (`load_resolved`) instead of checking again, and refuses a file that changed. Under plain
`torchrun -m colocate.train --config FILE`, local rank 0 of each node checks (its files are the
node's) and the node's other ranks take its resolved config from torchrun's store (`checked_once`).
`configure` is what a rank calls first: its config and the checkpoint to resume, or one line and
exit code 2 before any process group or model.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time

from colocate import run_dir
from colocate.config import Config, ConfigError
from colocate.launch import check_launch, config_from_text, config_text


RESOLVED_FLAGS = ("--resolved-config", "--config-sha256")
"""How `colocate train` hands the ranks the config it checked: its file, and the file's SHA-256."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_resolved(text: str) -> list[str]:
    """The launcher's resolved config in a file of its own -> the ranks' arguments naming it."""
    import tempfile
    data = text.encode()
    fd, path = tempfile.mkstemp(prefix="colocate-config-", suffix=".yaml")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return [f"{RESOLVED_FLAGS[0]}={path}", f"{RESOLVED_FLAGS[1]}={digest(data)}"]


def resolved_args(argv: list[str]) -> tuple[str, str] | None:
    """(file, SHA-256) when `argv` names a resolved config, else None (a config to check)."""
    given = {name: value for name, _, value in (a.partition("=") for a in argv) if name in RESOLVED_FLAGS}
    if not given:
        return None
    if len(given) != 2 or len(argv) != 2:
        raise ConfigError(f"{' and '.join(RESOLVED_FLAGS)} come together and alone (what `colocate train` passes "
                          f"its ranks); got {' '.join(argv)}")
    return given[RESOLVED_FLAGS[0]], given[RESOLVED_FLAGS[1]]


def load_resolved(path: str, sha256: str, world: int) -> Config:
    """The config `colocate train` checked, refused when its file is not the one checked."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"{RESOLVED_FLAGS[0]}={path}: cannot be read ({e.strerror or e}); start the run again "
                          "with `colocate train`") from None
    if digest(data) != sha256:
        raise ConfigError(f"{RESOLVED_FLAGS[0]}={path}: its SHA-256 is {digest(data)[:16]}..., not the "
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
    """A rank's config: the one `colocate train` checked (its hash verified), else checked once
    here (`checked_once`) -> (config, resume state, --check given)."""
    resolved = resolved_args(argv)
    if resolved is None:
        return checked_once(argv)
    cfg = load_resolved(*resolved, world=int(os.environ.get("WORLD_SIZE", "1")))
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
