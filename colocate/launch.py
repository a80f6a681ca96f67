"""Before launch: the config over its world size, the preflight checks, the run directory policy
and the checkpoint to resume, or one line and exit code 2 (`configure`) before any process group or
model - checked once per launch.

`colocate train` and `colocate check` parse the config in their own process (no torch: a mistyped
key or file is refused at once), make every path in it absolute, and run the other checks, which
import and call the user's code, in a forked child (`check_in_child`, `child.py`); the child sends
back the resolved config. `colocate train` writes it to a file and starts the ranks with
`--resolved-config=FILE --config-sha256=HEX`: each rank loads it and verifies the hash instead of
checking again (`start_config`). A rank started by plain `torchrun -m colocate.train --config ...`
checks on local rank 0 of its node; the node's other ranks wait for that rank's resolved config
(torchrun's store). `--check`, and ranks without torchrun's store, check in their own process.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass, replace

import yaml

from colocate import run_dir
from colocate.child import run_in_child
from colocate.config import Config, ConfigError, load_config, parse_overrides, to_dict
from colocate.jsonfile import write_atomic
from colocate.trackers import check_loggers

PATH_KEYS = (("model", "path"), ("model", "cache_dir"), ("env", "state_cache"), ("env", "data_files"),
             ("env", "eval_files"), ("metrics", "run_dir"), ("metrics", "profile_dir"), ("checkpoint", "resume"))
"""The config's paths, made absolute before any user code runs (`absolute_paths`)."""


def absolute(value):
    """A path from the working directory made absolute; '' and `auto` (checkpoint.resume) stay."""
    return os.path.abspath(value) if isinstance(value, str) and value not in ("", "auto") else value


def absolute_paths(cfg: Config) -> None:
    """Every path of `PATH_KEYS` absolute: user code that calls `os.chdir` (a reward module at
    import) then moves neither the run directory nor the data, and the ranks read the same files."""
    for section, key in PATH_KEYS:
        part = getattr(cfg, section)
        value = getattr(part, key)
        setattr(part, key, [absolute(v) for v in value] if isinstance(value, list) else absolute(value))


def parse_config(argv: list[str], world: int | None) -> tuple[Config, bool]:
    """The config and its overrides, values checked over `world`, paths absolute (no torch)."""
    path, overrides, resume = parse_overrides(argv)
    cfg = load_config(path, overrides, world_size=world)
    absolute_paths(cfg)
    return cfg, resume


def config_text(cfg: Config) -> str:
    """The resolved config as YAML (what `--check` prints and the ranks load)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_from_text(text: str, what: str, world: int) -> Config:
    """A resolved config's text -> the config, its values checked again over `world` (cheap)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: not a resolved config (a YAML mapping of sections)")
    return load_config(None, data, world_size=world)


@dataclass(frozen=True)
class CheckFlags:
    """What `--check [--world-size N] [--gpu-memory SIZE [--gpus-per-node G]]` asked for."""
    rest: list[str]
    """The other arguments (the config and its overrides)."""
    check_only: bool
    world: int | None
    """Under torchrun torchrun's world size; a check before launch `--world-size N`, else None: the
    processes `colocate train` would start (`default_world`)."""
    card: "CardSpec | None"  # noqa: F821 - preflight.CardSpec (imported where a card is given: it brings torch)
    """A card to plan for instead of this machine's (`gpu_budget.parse_gpu_memory`); checks only."""


def split_check_flags(argv: list[str]) -> CheckFlags:
    check_only, world, memory, per_node, rest = False, None, None, None, []
    it = iter(argv)
    for arg in it:
        name, sep, value = arg.partition("=")
        if arg == "--check":
            check_only = True
        elif name in ("--world-size", "--gpu-memory", "--gpus-per-node"):
            value = value if sep else next(it, "")
            if name == "--gpu-memory":
                memory = value
            elif not value.isdigit() or int(value) < (2 if name == "--world-size" else 1):
                raise ConfigError(f"{name}={value!r}: expected an integer >= "
                                  + ("2 (one rank of each role)" if name == "--world-size" else "1"))
            elif name == "--world-size":
                world = int(value)
            else:
                per_node = int(value)
        else:
            rest.append(arg)
    if (memory is not None or per_node is not None) and not check_only:
        raise ConfigError("--gpu-memory / --gpus-per-node plan a card for `colocate check`; a run plans the GPUs "
                          "it has")
    if per_node is not None and memory is None:
        raise ConfigError("--gpus-per-node: give the card too (--gpu-memory 80GiB, or h100, h200)")
    card = None
    if memory is not None:
        from colocate.preflight import CardSpec
        card = CardSpec(memory, per_node)
    if "WORLD_SIZE" in os.environ:
        return CheckFlags(rest, check_only, int(os.environ["WORLD_SIZE"]), card)
    return CheckFlags(rest, check_only, world or (None if check_only else 1), card)


def default_world(cfg: Config) -> int:
    """The processes `colocate train` starts on one node without `--nproc` (and `colocate check`
    checks without `--world-size`): inference + learner ranks when the config fixes both, else this
    machine's GPU count (at least 2)."""
    t = cfg.topology
    if t.num_inference and t.num_learners:
        return t.num_inference + t.num_learners
    import torch
    # device_count asks NVML and leaves CUDA uninitialised: the launcher's checks run in a fork
    return max(2, torch.cuda.device_count())


def check_resume_overwrite(cfg: Config, resume_flag: bool, overwrite: bool) -> None:
    """`--overwrite` deletes the run that `--resume` (or checkpoint.resume) would continue from."""
    if overwrite and (resume_flag or cfg.checkpoint.resume):
        how = "--resume" if resume_flag else f"checkpoint.resume={cfg.checkpoint.resume!r}"
        raise ConfigError(f"--overwrite and {how} contradict: --overwrite starts {cfg.metrics.run_dir} afresh, "
                          f"{how} continues a run; pass one of them")


def load_resume(cfg: Config, resume_flag: bool) -> dict | None:
    """The checkpoint to continue from (validated), or None. `--resume` means checkpoint.resume=auto.
    The newer checkpoints skipped are printed here: one process checks a launch (the launcher's
    child, or one rank under plain torchrun), and the ranks load the path it pinned."""
    from colocate.checkpoint import check_same_task, load_checkpoint, resolve_resume
    trust = cfg.checkpoint.trust_unverified
    path, skipped = resolve_resume("auto" if resume_flag and not cfg.checkpoint.resume else cfg.checkpoint.resume,
                                   cfg.metrics.run_dir, trust)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in skipped:
            print(f"colocate: resume: {line}", file=sys.stderr, flush=True)
    if path is None:
        return None
    state = load_checkpoint(path, trust)
    check_same_task(cfg, path)
    check_same_env(cfg, state["trainer_state"], path)
    state["path"] = path
    return state


def saved_env_states(trainer_state: dict) -> list[dict]:
    """The env resume states the inference ranks saved (ranks whose env keeps none left out)."""
    return [s["env"] for s in (trainer_state.get("inference") or {}).values()
            if isinstance(s, dict) and isinstance(s.get("env"), dict)]


def check_same_env(cfg: Config, trainer_state: dict, path: str) -> None:
    """The env's own resume rules (`envs.check_env_resume`: e.g. the dataset env's files, the number
    of env copies) against the env states the checkpoint at `path` holds."""
    from colocate.checkpoint import CheckpointError
    from colocate.envs import check_env_resume
    from colocate.envs.base import ResumeError
    try:
        check_env_resume(saved_env_states(trainer_state), cfg)
    except ResumeError as e:
        raise CheckpointError(f"{path}: {e}") from None


@dataclass(frozen=True)
class Checked:
    """What the checks are asked about: the parsed config and the command's flags."""
    cfg: Config
    flags: CheckFlags
    resume: bool
    """--resume given."""
    overwrite: bool
    """--overwrite given."""
    world: int
    local_world: int


def parse_request(argv: list[str], world: int | None = None, local_world: int | None = None) -> Checked:
    """The arguments of a check -> what to check (parsing and values only: no torch, no user code)."""
    argv, overwrite = run_dir.split_overwrite(argv)
    flags = split_check_flags(argv)
    world = world or flags.world
    if world is None:  # a check without --world-size: the world `colocate train` would start
        world = default_world(parse_config(flags.rest, None)[0])
    cfg, resume = parse_config(flags.rest, world)
    return Checked(cfg, flags, resume, overwrite, world, local_world or int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def check_parsed(c: Checked) -> None:
    """The checks past parsing: preflight (the files, the model, the env and the user's code it
    names, each GPU's memory plan), the loggers, the run directory policy (`run_dir.claim`; only a
    real run deletes), and rank 0's memory plan file."""
    from colocate.preflight import preflight
    cfg, check_only = c.cfg, c.flags.check_only
    in_a_rank = "WORLD_SIZE" in os.environ
    check_resume_overwrite(cfg, c.resume, c.overwrite)
    plan = preflight(cfg, c.world, c.local_world, c.flags.card,
                     show_plan=not check_only and (not in_a_rank or "TORCHELASTIC_RUN_ID" in os.environ))
    # the run trains at the plan's budget (`learner.micro_batch_tokens: auto` resolved there)
    cfg.learner = replace(cfg.learner, micro_batch_tokens=plan.micro_batch_tokens)
    check_loggers(cfg)
    # `--check` refuses what a run would refuse (the same `--resume` / `--overwrite`), and deletes nothing
    one_process = not check_only and int(os.environ.get("RANK", "0")) == 0
    run_dir.claim(cfg, resume=c.resume or bool(cfg.checkpoint.resume), overwrite=c.overwrite, remove=one_process)
    if one_process and plan.estimates_gib:  # the launcher, or rank 0 of a GPU run checking for itself
        # each rank's estimated peak, which the learners' summary sets beside the measured ones
        write_atomic(os.path.join(cfg.metrics.run_dir, "memory_plan.json"), plan.estimates_gib)
    if check_only:
        echo_check(cfg, plan.lines)


def echo_check(cfg: Config, plan_lines: list[str]) -> None:
    """What `--check` shows: the resolved config (stdout), then the memory plan (stderr), last, so
    that a long config does not scroll it away."""
    from colocate.gpu_budget import print_plan
    print(config_text(cfg), end="", flush=True)
    print_plan(plan_lines)


def check_config(argv: list[str], world: int | None = None,
                 local_world: int | None = None) -> tuple[Config, bool, bool]:
    """Every check but the checkpoint to resume (`parse_request`, `check_parsed`) -> (config, --resume
    given, --check given); raises ConfigError. The launcher's checks and a rank that checks for
    itself go through `check_launch`, which adds the checkpoint."""
    c = parse_request(argv, world, local_world)
    check_parsed(c)
    return c.cfg, c.resume, c.flags.check_only


def checked(c: Checked) -> dict | None:
    """Every check past parsing (`check_parsed`), then the checkpoint to resume, validated, its path
    pinned in the config as checkpoint.resume (the ranks load that one, and the run's config.yaml
    says which it was) -> its state, or None."""
    check_parsed(c)
    resume = load_resume(c.cfg, c.resume)  # one process checks a launch: it names the skipped checkpoints once
    c.cfg.checkpoint.resume = resume["path"] if resume else ""
    return resume


def check_launch(argv: list[str], world: int | None = None,
                 local_world: int | None = None) -> tuple[Config, dict | None, bool]:
    """Every check (`parse_request`, then `checked`: `check_parsed` and the checkpoint to resume,
    validated) -> (config, resume state, --check given); raises ConfigError or CheckpointError. What
    the launcher's checking child, a rank checking for itself and `--check` refuse before any
    process group forms."""
    c = parse_request(argv, world, local_world)
    return c.cfg, checked(c), c.flags.check_only


def resolved_text(c: Checked) -> str:
    """The checking child's work: every check -> the resolved config's text ("" for `--check`, which
    printed it with its plan, `echo_check`)."""
    checked(c)
    return "" if c.flags.check_only else config_text(c.cfg)


def refusal(error: BaseException) -> tuple[int, str]:
    """A check's raise -> (exit code, the line): 2 for bad input, else the check failed (user code
    raising `SystemExit` at import, a bug) and the line names where."""
    from colocate.checkpoint import CheckpointError
    from colocate.lifecycle import failure_frame, shown_path
    if isinstance(error, (ConfigError, CheckpointError)):
        return 2, f"colocate: {'config' if isinstance(error, ConfigError) else 'checkpoint'} error: {error}"
    if isinstance(error, KeyboardInterrupt):
        return 130, ""
    frame = failure_frame(error)
    at = f"; at {frame.name} ({shown_path(frame.filename)}:{frame.lineno})" if frame else ""
    message = (str(error).splitlines() or [""])[0]
    return 1, f"colocate: failed: the checks before launch raised {type(error).__name__}: {message}{at}"


def ended_early(code: int) -> tuple[int, str]:
    """The checking child ended without its result -> (exit code, the line)."""
    import signal
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return (128 - code if code < 0 else 1,
            f"colocate: failed: the checks before launch ended without a result (their process {how}): user code "
            "they call (env.name, env.reward, env.tools, env.environment) must not end its process (os._exit, "
            "a signal)")


def check_in_child(argv: list[str], world: int | None = None, local_world: int | None = None) -> tuple[int, str]:
    """`colocate train` / `colocate check`: parse here (no torch), check in a forked child (the user's
    code cannot end, break or move this process) -> (exit code, the resolved config's text). On a
    code other than 0 the line has been printed. Raises ConfigError (parsing)."""
    c = parse_request(argv, world, local_world)
    # The checks' heaviest imports (the meta model's) are made here, before the fork: the launcher
    # pays them once either way, and a second check in this process (a test's) starts warm.
    import transformers.modeling_utils  # noqa: F401
    ended = run_in_child(lambda: resolved_text(c), refusal)
    if ended.own_end:  # the config, or the refusal's line printed there
        return ended.code, ended.result or ""
    code, line = ended_early(ended.code)
    print(line, file=sys.stderr, flush=True)
    return code, ""


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
