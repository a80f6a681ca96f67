"""Before launch: the config over its world size, the preflight checks, the run directory policy
and the checkpoint to resume, or one line and exit code 2 - checked once per launch.

`colocate train` and `colocate check` parse the config in their own process (no torch: a mistyped
key or file is refused at once), make every path in it absolute, and run the other checks, which
import and call the user's code, in a forked child (`check_in_child`, `child.py`); the child sends
back the resolved config. `colocate train` forks that child (`start_checks`) and starts torchrun
beside it; it hands the ranks the checked config, or a refusal, through `handover.py`: each rank
loads the config and verifies its hash instead of checking again. How a rank gets its config (that
file, or one checked once per node under plain torchrun) is `rank_config.py`'s.
"""
from __future__ import annotations

import gc
import importlib
import os
import sys
from dataclasses import dataclass, replace

import yaml

from colocate import run_dir
from colocate.child import Child, Ended, finish_child, start_child
from colocate.config import Config, ConfigError, load_config, parse_overrides, to_dict
from colocate.jsonfile import write_atomic
from colocate.startup import check_phase, check_phase_ends
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
    check_phase("claim")
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
    check_phase("resume")
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


def import_frozen(module: str) -> None:
    """Import `module` (when not yet imported) with the cycle collector off, then freeze the heap
    (`lifecycle.freeze_heap`): collections deferred by `gc.disable` alone would walk it all in the
    forked child instead; frozen, neither the child (gc.freeze's documentation advises it before a
    fork) nor the launcher's later collections walk it."""
    from colocate.lifecycle import freeze_heap
    if module in sys.modules:
        return
    collecting = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module(module)
    finally:
        freeze_heap()
        if collecting:
            gc.enable()


def checks_result(ended: Ended) -> tuple[int, str, dict[str, float]]:
    """How the checking child ended -> (exit code, the resolved config's text, the phases' ends:
    `startup.CHECK_PHASES`, unix seconds); on a code other than 0 the line has been printed (by the
    child, or here for one that ended without a result)."""
    if ended.own_end and ended.result is not None:
        ends, _, text = ended.result.partition("\n")
        return ended.code, text, {name: float(end) for name, _, end in (e.partition("=") for e in ends.split())}
    if ended.own_end:  # the refusal's line printed there
        return ended.code, "", {}
    code, line = ended_early(ended.code)
    print(line, file=sys.stderr, flush=True)
    return code, "", {}


def checked_text(c: Checked) -> str:
    """The checking child's work (`resolved_text`), the meta model's imports made first, frozen (a
    no-op where the launcher made them before the fork) -> its result: a line of the phases' ends
    (`startup.CHECK_PHASES`, `name=unix` each), then the resolved config's text."""
    import_frozen("transformers.modeling_utils")
    check_phase("child_imports")
    text = resolved_text(c)
    check_phase("resolved_config")
    # written by hand, not by json: the user's code the checks called may have patched it
    return " ".join(f"{name}={end!r}" for name, end in check_phase_ends().items()) + "\n" + text


def start_checks(c: Checked) -> Child:
    """Fork the child that checks `c` (`checked_text`) and return at once: `colocate train` starts
    torchrun meanwhile, and `finish_child` + `checks_result` give the outcome."""
    return start_child(lambda: checked_text(c), refusal)


def check_in_child(argv: list[str], world: int | None = None, local_world: int | None = None) -> tuple[int, str]:
    """`colocate check`: parse here (no torch), check in a forked child (the user's code cannot end,
    break or move this process) -> (exit code, the resolved config's text). On a code other than 0
    the line has been printed. Raises ConfigError (parsing)."""
    c = parse_request(argv, world, local_world)
    # The checks' heaviest imports (the meta model's) are made here, before the fork: a second check
    # in this process (a test's) starts warm.
    import_frozen("transformers.modeling_utils")
    return checks_result(finish_child(start_checks(c)))[:2]
