"""Before launch: the config over its world size, the preflight checks, the run directory policy
and the checkpoint to resume, or one line and exit code 2 (`configure`) before any process group or
model. Every rank under torchrun, `--check` and `colocate train` (before it starts torchrun) run it.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace

from colocate import run_dir
from colocate.config import Config, ConfigError, load_config, parse_overrides
from colocate.jsonfile import write_atomic
from colocate.preflight import CardSpec, preflight
from colocate.topology import place_roles
from colocate.trackers import check_loggers


def parse_config(argv: list[str], world: int | None) -> tuple[Config, bool]:
    path, overrides, resume = parse_overrides(argv)
    return load_config(path, overrides, world_size=world), resume


@dataclass(frozen=True)
class CheckFlags:
    """What `--check [--world-size N] [--gpu-memory SIZE [--gpus-per-node G]]` asked for."""
    rest: list[str]
    """The other arguments (the config and its overrides)."""
    check_only: bool
    world: int | None
    """Under torchrun torchrun's world size; a check before launch `--world-size N`, else None: the
    processes `colocate train` would start (`default_world`)."""
    card: CardSpec | None
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
    card = CardSpec(memory, per_node) if memory is not None else None
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
    return max(2, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def check_resume_overwrite(cfg: Config, resume_flag: bool, overwrite: bool) -> None:
    """`--overwrite` deletes the run that `--resume` (or checkpoint.resume) would continue from."""
    if overwrite and (resume_flag or cfg.checkpoint.resume):
        how = "--resume" if resume_flag else f"checkpoint.resume={cfg.checkpoint.resume!r}"
        raise ConfigError(f"--overwrite and {how} contradict: --overwrite starts {cfg.metrics.run_dir} afresh, "
                          f"{how} continues a run; pass one of them")


def load_resume(cfg: Config, resume_flag: bool, show: bool = True) -> dict | None:
    """The checkpoint to continue from (validated), or None. `--resume` means checkpoint.resume=auto.
    `show`: print the newer checkpoints skipped (rank 0 of a run, or a check: not `colocate train`'s
    own check before it starts the ranks, which would print them a second time)."""
    from colocate.checkpoint import check_same_task, load_checkpoint, resolve_resume
    trust = cfg.checkpoint.trust_unverified
    path, skipped = resolve_resume("auto" if resume_flag and not cfg.checkpoint.resume else cfg.checkpoint.resume,
                                   cfg.metrics.run_dir, trust)
    if show and int(os.environ.get("RANK", "0")) == 0:
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


def check_config(argv: list[str], world: int | None = None,
                 local_world: int | None = None) -> tuple[Config, bool, bool]:
    """Everything checked before launch -> (config, --resume given, --check given); raises
    ConfigError. `--check`, every rank under torchrun and `colocate train` (before it starts
    torchrun, with the world it will ask for) run this one function: the config over its world
    size, the preflight checks, and the run directory policy (`run_dir.claim`; only a real run deletes)."""
    argv, overwrite = run_dir.split_overwrite(argv)
    flags = split_check_flags(argv)
    argv, check_only, world = flags.rest, flags.check_only, world or flags.world
    if world is None:  # a check without --world-size: the world `colocate train` would start
        world = default_world(parse_config(argv, None)[0])
    cfg, resume_flag = parse_config(argv, world)
    check_resume_overwrite(cfg, resume_flag, overwrite)
    plan = preflight(cfg, world, local_world or int(os.environ.get("LOCAL_WORLD_SIZE", world)), flags.card,
                     show_plan=not check_only and "TORCHELASTIC_RUN_ID" in os.environ)
    # the run trains at the plan's budget (`learner.micro_batch_tokens: auto` resolved there)
    cfg.learner = replace(cfg.learner, micro_batch_tokens=plan.micro_batch_tokens)
    check_loggers(cfg)
    # `--check` refuses what a run would refuse (the same `--resume` / `--overwrite`), and deletes nothing
    one_process = not check_only and int(os.environ.get("RANK", "0")) == 0
    run_dir.claim(cfg, resume=resume_flag or bool(cfg.checkpoint.resume), overwrite=overwrite, remove=one_process)
    if one_process and plan.estimates_gib and "WORLD_SIZE" in os.environ:  # rank 0 of a GPU run
        # each rank's estimated peak, which the learners' summary sets beside the measured ones
        write_atomic(os.path.join(cfg.metrics.run_dir, "memory_plan.json"), plan.estimates_gib)
    if check_only:
        echo_check(cfg, plan.lines)
    return cfg, resume_flag, check_only


def echo_check(cfg: Config, plan_lines: list[str]) -> None:
    """What `--check` shows: the resolved config (stdout), then the memory plan (stderr), last, so
    that a long config does not scroll it away."""
    import yaml

    from colocate.config import to_dict
    from colocate.gpu_budget import print_plan
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="", flush=True)
    print_plan(plan_lines)


def check_launch(argv: list[str], world: int | None = None,
                 local_world: int | None = None) -> tuple[Config, dict | None, bool]:
    """`check_config`, then the checkpoint to resume (validated) -> (config, resume state, --check
    given); raises ConfigError or CheckpointError. What every rank, `--check` and `colocate train`
    refuse before any process group forms."""
    cfg, resume_flag, check_only = check_config(argv, world, local_world)
    return cfg, load_resume(cfg, resume_flag, show=check_only or "TORCHELASTIC_RUN_ID" in os.environ), check_only


OTHER_RANKS_WAIT_S = 60.0  # how long a refusing rank other than 0 waits for the launcher to stop it


def configure(argv: list[str]) -> tuple[Config, dict | None, bool]:
    """Config, preflight checks and the checkpoint to resume, or one line and exit code 2 (before any
    process group or model). Under torchrun every rank refuses; rank 0 prints the line and exits, and the
    launcher stops the others while they wait. A rank still alive after `OTHER_RANKS_WAIT_S` (its input
    differs, a file only its node sees; or another node's launcher did not stop it) prints its own line."""
    from colocate.checkpoint import CheckpointError
    try:
        if "WORLD_SIZE" not in os.environ and "--check" not in argv:
            raise ConfigError("not started by torchrun: run `colocate train --config FILE [--nproc N]`, or "
                              "`torchrun --nproc-per-node=N -m colocate.train --config FILE` (`--check` only checks)")
        cfg, resume, check_only = check_launch(argv)
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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    roles = place_roles(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return roles[int(os.environ.get("RANK", "0"))]
