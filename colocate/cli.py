"""`colocate`: the command a user types (`colocate train|eval|check|export`).

    colocate train  --config FILE [--nproc N] [--overwrite|--resume] [torchrun flags] [--section.key=value ...]
    colocate check  --config FILE [--world-size N] [--gpu-memory SIZE|CARD [--gpus-per-node G]] [--section.key=value ...]
    colocate eval   --config FILE [--checkpoint DIR] | --run DIR [--out FILE] [--opponents greedy,random] [--games N] [...]
    colocate export --run DIR [--merge] --out DIR
    colocate <command> --help [SECTION]

`train` checks everything `--check` checks (`launch.check_config`, with the world size it is about
to ask for) in this process, then runs torchrun in it (`python -m torch.distributed.run
--nproc-per-node N -m colocate.train ...`): a bad config is one line and exit code 2, and no
torchrun starts; a failed job exits with the failed rank's code, without torchrun's summary. Flags
that are not ours or config keys (`--nnodes`, `--node-rank`, `--rdzv-endpoint`, ...) go to torchrun
as given. `torchrun -m colocate.train` works as before.

This module is the top of the import graph: nothing imports it.
"""
from __future__ import annotations

import dataclasses
import os
import sys

from colocate.config import Config, ConfigError, field_docs, load_config, parse_overrides

COMMANDS = {
    "train": "check the config, then start torchrun with the right number of processes",
    "check": "check a config (values, world size, files, model, each GPU's memory plan) and print it resolved",
    "eval": "evaluate a saved adapter (or the base model) on the config's env",
    "export": "write a run's final adapter (peft format), or with --merge a merged Hugging Face model",
}
USAGE = {
    "train": "colocate train --config FILE [--nproc N] [--overwrite | --resume] [torchrun flags: --nnodes N "
             "--node-rank R --rdzv-endpoint HOST:PORT ...] [--section.key=value ...]",
    "check": "colocate check --config FILE [--world-size N] [--gpu-memory 80GiB|h100|h200 [--gpus-per-node G]] "
             "[--overwrite | --resume] [--section.key=value ...]",
    "eval": "colocate eval (--config FILE [--checkpoint DIR] | --run RUN_DIR) [--out FILE] [--opponents greedy,random] "
            "[--games N] [--section.key=value ...]\n\n--checkpoint: a run's adapter/ (RUN_DIR/adapter), an exported "
            "adapter or a checkpoints/step-* directory; --run: RUN_DIR/adapter with RUN_DIR/config.yaml. Writes "
            "<run>/evals/<name>/metrics.json (or --out)",
    "export": "colocate export --run DIR [--merge] --out DIR",
}
TORCHRUN_VALUE_FLAGS = {"--nnodes", "--node-rank", "--node_rank", "--master-addr", "--master_addr", "--master-port",
                        "--master_port", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint",
                        "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--max-restarts", "--max_restarts",
                        "--monitor-interval", "--log-dir", "--log_dir", "--redirects", "--tee", "--local-addr"}
"""torchrun flags that take a value as the next argument (`--flag=value` works for any flag)."""
TORCHRUN_FLAGS = TORCHRUN_VALUE_FLAGS | {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path",
                                         "--local-ranks-filter", "--local_ranks_filter"}
"""torchrun flags `colocate train` passes through; any other flag is an argument of ours."""


def sections() -> dict[str, type]:
    return {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}


def section_help(name: str) -> str:
    """The keys of one config section with their defaults and docstrings (config_schema.py)."""
    if name not in sections():
        raise ConfigError(f"no config section {name!r}; sections: {', '.join(sections())}")
    cls = sections()[name]
    docs, default = field_docs(cls), cls()
    lines = [f"[{name}]"]
    for f in dataclasses.fields(cls):
        lines.append(f"  --{name}.{f.name}={getattr(default, f.name)!r}")
        lines += [f"      {line.strip()}" for line in docs.get(f.name, "").strip().splitlines()]
    return "\n".join(lines)


def command_help(command: str | None) -> str:
    if command is None:
        return ("usage: colocate <command> [options]\n\ncommands:\n"
                + "\n".join(f"  {c:<7} {text}" for c, text in COMMANDS.items())
                + "\n\n`colocate <command> --help` for its options, `colocate check --help SECTION` for a "
                  "config section's keys.")
    text = f"usage: {USAGE[command]}\n\n{COMMANDS[command]}."
    if command != "export":
        text += ("\n\nconfig sections (`--help SECTION` lists the keys): " + ", ".join(sections())
                 + "\nfloats take any notation (3e-3, 1e-6, .5); lists are comma separated (a,b or [a,b]).")
    return text


def wants_help(argv: list[str]) -> tuple[bool, str | None]:
    """(`--help`/`-h` given, the SECTION after it if any)."""
    for i, arg in enumerate(argv):
        if arg in ("--help", "-h"):
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else None
            return True, nxt
    return False, None


def split_train_args(argv: list[str]) -> tuple[int | None, list[str], list[str]]:
    """-> (--nproc, torchrun flags, colocate.train arguments)."""
    nproc, torchrun, ours, it = None, [], [], iter(argv)
    for arg in it:
        name, sep, value = arg.partition("=")
        if name in ("--nproc", "--nproc-per-node", "--nproc_per_node"):
            value = value if sep else next(it, "")
            if not value.isdigit() or int(value) < 2:
                raise ConfigError(f"{name}={value!r}: expected an integer >= 2 (one rank of each role)")
            nproc = int(value)
        elif name in ("--config", "--resume", "--overwrite") or ("." in name and name.startswith("--")):
            ours.append(arg)
            if name == "--config" and not sep:
                ours.append(next(it, ""))
        elif name in TORCHRUN_FLAGS:
            torchrun.append(arg)
            if name in TORCHRUN_VALUE_FLAGS and not sep:
                torchrun.append(next(it, ""))
        else:  # config overrides and what is neither: `parse_overrides` names the mistake
            ours.append(arg)
    return nproc, torchrun, ours


def torchrun_value(flags: list[str], *names: str) -> str | None:
    for i, arg in enumerate(flags):
        name, sep, value = arg.partition("=")
        if name in names:
            return value if sep else (flags[i + 1] if i + 1 < len(flags) else None)
    return None


def default_nproc(cfg: Config) -> int:
    """inference + learner ranks when the config fixes both, else the GPU count (at least 2)."""
    t = cfg.topology
    if t.num_inference and t.num_learners:
        return t.num_inference + t.num_learners
    import torch
    return max(2, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def train_command(argv: list[str]) -> list[str]:
    """Check everything in this process -> the torchrun command line (raises ConfigError)."""
    from colocate.launch import check_launch
    nproc, torchrun, ours = split_train_args(argv)
    path, overrides, _ = parse_overrides([a for a in ours if a != "--overwrite"])
    if path is None:
        raise ConfigError("--config FILE is required")
    nproc = nproc or default_nproc(load_config(path, overrides))
    nnodes = torchrun_value(torchrun, "--nnodes") or "1"
    world = nproc * int(nnodes) if nnodes.isdigit() else None  # an elastic range: torchrun decides
    check_launch(ours, world=world, local_world=nproc)
    single = nnodes == "1" and not torchrun_value(torchrun, "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                                                    "--master_addr")
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            *(["--standalone"] if single and "--standalone" not in torchrun else []), *torchrun,
            "-m", "colocate.train", *ours]


def launch_env(nproc: int) -> dict[str, str]:
    """The ranks' environment: OMP_NUM_THREADS set (torchrun prints a banner when it is not; each
    rank splits its cores again, `topology.split_cpu_threads`), Python warnings as given."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def train(argv: list[str]) -> int:
    import psutil
    from colocate.checkpoint import CheckpointError
    from colocate.startup import LAUNCH_ENV
    launched_at = repr(psutil.Process().create_time())  # the command's start: the ranks' timeline counts from it
    try:
        cmd = train_command(argv)
    except CheckpointError as e:  # a checkpoint to resume that does not verify: as every rank would say it
        print(f"colocate: checkpoint error: {e}", file=sys.stderr, flush=True)
        return 2
    nproc = int(cmd[3].partition("=")[2])  # cmd[3] is --nproc-per-node=N
    sys.stdout.flush()
    os.environ.update(launch_env(nproc))
    os.environ[LAUNCH_ENV] = launched_at  # for these ranks only: a later launch from this process has its own
    try:
        return run_torchrun(cmd[3:])
    finally:
        del os.environ[LAUNCH_ENV]


def run_torchrun(args: list[str]) -> int:
    """torchrun (its arguments after `-m torch.distributed.run`) in this process -> the job's exit
    code: 0, else the first failed rank's own (2 bad input, 3 metrics.stop_on_collapse or
    stop_on_mismatch, 1 a rank failed; 128 + N for a rank killed by signal N), where torchrun itself would say 1. The rank
    that failed has printed its one line; torchrun's log lines and its failure summary stay out of
    the terminal (`LOGLEVEL=INFO` brings its log back)."""
    import logging
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # torch.distributed.elastic's loggers read it when made
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    for name in list(logging.root.manager.loggerDict):  # those made before this call
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(os.environ["LOGLEVEL"])
    try:
        run(parse_args(args))
    except ChildFailedError as e:
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code
    except SignalException as e:  # SIGTERM / Ctrl-C: torchrun passed it on to the ranks
        return 128 + int(e.sigval)
    return 0


def check(argv: list[str]) -> int:
    from colocate.train import main
    main(["--check", *argv])
    return 0


def evaluate(argv: list[str]) -> int:
    """`--opponents` and `--games` are eval.opponents and eval.games."""
    from colocate.eval import main
    rest, it = [], iter(argv)
    for arg in it:
        name, sep, value = arg.partition("=")
        if name in ("--opponents", "--games"):
            rest.append(f"--eval.{name[2:]}={value if sep else next(it, '')}")
        else:
            rest.append(arg)
    main(rest)
    return 0


def export(argv: list[str]) -> int:
    from colocate.export import main
    return main(argv)


RUN = {"train": train, "check": check, "eval": evaluate, "export": export}


def unknown_command(argv: list[str]) -> str | None:
    """The line refusing a first argument that is no command (None: there is none, or `--help`)."""
    import difflib
    if not argv or argv[0] in ("--help", "-h"):
        return None
    near = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f" (commands: {', '.join(COMMANDS)})"
    return f"colocate: unknown command {argv[0]!r}{hint}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    show, section = wants_help(argv)
    try:
        if command is None:  # `colocate --help` is the usage; no command, or an unknown one, is an error
            if show and not unknown_command(argv):
                print(command_help(None))
                return 0
            print(unknown_command(argv) or "colocate: a command is required", file=sys.stderr)
            print(command_help(None), file=sys.stderr)
            return 2
        if show:
            print(section_help(section) if section else command_help(command))
            return 0
        return RUN[command](argv[1:])
    except ConfigError as e:
        print(f"colocate: config error: {e}", file=sys.stderr, flush=True)
        return 2


def entry() -> None:
    """The `colocate` console script: `main`, then `lifecycle.leave` with its code."""
    from colocate.lifecycle import leave
    leave(main())


if __name__ == "__main__":
    entry()
