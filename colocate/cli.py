"""`colocate`: the command a user types (`colocate train|eval|check|export`).

    colocate train  --config FILE [--nproc N] [--overwrite|--resume] [torchrun flags] [--section.key=value ...]
    colocate check  --config FILE [--world-size N] [--gpu-memory SIZE|CARD [--gpus-per-node G]] [--section.key=value ...]
    colocate eval   --config FILE [--checkpoint DIR] | --run DIR [--out FILE] [--opponents greedy,random] [--games N] [...]
    colocate export --run DIR [--merge] --out DIR
    colocate <command> --help [SECTION]

The front: the commands, their help and each config section's keys, one line and exit code 2 for a
config error. `train` is `launcher.py`'s (torchrun beside the checks, the checked config handed to
the ranks, the job's end said in one line); `check` runs the same checks in a forked child
(`launch.check_in_child`) and prints the resolved config.

This module is the top of the import graph: nothing imports it.
"""
from __future__ import annotations

import dataclasses
import sys

from colocate import launcher
from colocate.config import Config, ConfigError, field_docs

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


def check(argv: list[str]) -> int:
    """The checks of `train` (in a child, `launch.check_in_child`), then the resolved config."""
    from colocate.launch import check_in_child
    code, text = check_in_child(["--check", *argv])
    print(text, end="")
    return code


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


RUN = {"train": launcher.train, "check": check, "eval": evaluate, "export": export}


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
    except KeyboardInterrupt:  # Ctrl-C before torchrun took the signals over (then it stops the ranks)
        print(launcher.interrupted_line(command), file=sys.stderr, flush=True)
        return 128 + 2


def entry() -> None:
    """The `colocate` console script: `main`, then `lifecycle.leave` with its code."""
    from colocate.lifecycle import leave
    leave(main())


if __name__ == "__main__":
    entry()
