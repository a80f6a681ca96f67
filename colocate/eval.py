"""`python -m colocate.eval --config CFG [--checkpoint DIR] [--out FILE] [--device cpu] [--section.key=value ...]`

Held-out evaluation of a saved adapter, outside a training run: the same `Env.evaluate` the
inference rank calls every `eval.every` steps, on the HF reference engine in this one process.
Without `--checkpoint` the base model is scored (adapter version 0, which changes nothing).
Prints the metrics as JSON and writes them to `--out` (default
`<metrics.run_dir>/eval/eval-<checkpoint name or base>.json`); the env's samples go beside it.
Bad input (config, checkpoint) is one line and exit code 2 before any model is built.
"""
from __future__ import annotations

import json
import os
import sys

from colocate.config import Config, ConfigError, load_config, parse_overrides
from colocate.metrics import write_json_atomic


def split_flags(argv: list[str]) -> tuple[list[str], dict]:
    """Our own flags (--checkpoint, --out, --device) out of the config arguments."""
    flags, rest, it = {"checkpoint": "", "out": "", "device": "cpu"}, [], iter(argv)
    for arg in it:
        name, sep, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name in flags:
            value = value if sep else next(it, None)
            if value is None:
                raise ConfigError(f"--{name} needs a value")
            flags[name] = value
        else:
            rest.append(arg)
    return rest, flags


def configure(argv: list[str]) -> tuple[Config, dict, dict | None]:
    """Config, flags and the checkpoint (verified), or one line and exit code 2."""
    from colocate.checkpoint import CheckpointError, check_same_task, load_checkpoint
    from colocate.preflight import check_custom_env, check_dataset, check_model_dir
    try:
        rest, flags = split_flags(argv)
        path, overrides, _ = parse_overrides(rest)
        if path is None:
            raise ConfigError("--config FILE is required")
        cfg = load_config(path, overrides)
        check_model_dir(cfg.model.path)
        check_dataset(cfg)
        check_custom_env(cfg)
        checkpoint = None
        if flags["checkpoint"]:
            if not os.path.isdir(flags["checkpoint"]):
                raise CheckpointError(f"{flags['checkpoint']}: no such checkpoint directory")
            checkpoint = load_checkpoint(flags["checkpoint"])
            check_same_task(cfg, flags["checkpoint"])
    except (ConfigError, CheckpointError) as e:
        kind = "config" if isinstance(e, ConfigError) else "checkpoint"
        print(f"colocate: {kind} error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    return cfg, flags, checkpoint


def evaluate(cfg: Config, checkpoint: dict | None, *, device: str = "cpu", out_dir: str | None = None) -> dict:
    """Tokenizer, base model + adapter, HF engine, env -> the env's evaluation metrics."""
    from colocate.checkpoint import check_adapter_matches
    from colocate.engine.hf import HFEngine
    from colocate.envs import env_corpus, make_env
    from colocate.models import load_tokenizer
    from colocate.models import build_policy
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    engine = HFEngine(build_policy(cfg, tokenizer, device), tokenizer, device=device, seed=cfg.rollout.seed)
    if checkpoint is not None:
        check_adapter_matches(checkpoint["adapter"], engine.lora_state(), checkpoint.get("path", "checkpoint"))
        engine.load_lora(checkpoint["trainer_state"]["version"], checkpoint["adapter"])
    env = make_env(cfg, tokenizer, seed=cfg.rollout.seed * 1000)
    return {k: float(v) for k, v in env.evaluate(engine, cfg.eval, out_dir).items()}


def main(argv: list[str] | None = None) -> dict:
    cfg, flags, checkpoint = configure(sys.argv[1:] if argv is None else argv)
    name = os.path.basename(os.path.normpath(flags["checkpoint"])) if flags["checkpoint"] else "base"
    out = flags["out"] or os.path.join(cfg.metrics.run_dir, "eval", f"eval-{name}.json")
    if checkpoint is not None:
        checkpoint["path"] = flags["checkpoint"]
    metrics = evaluate(cfg, checkpoint, device=flags["device"], out_dir=os.path.dirname(os.path.abspath(out)))
    result = {"checkpoint": flags["checkpoint"] or None, "env": cfg.env.name,
              "version": checkpoint["trainer_state"]["version"] if checkpoint else 0, "metrics": metrics}
    write_json_atomic(out, result)
    print(json.dumps(result, indent=2))
    if not metrics:
        print(f"colocate: env {cfg.env.name} has nothing to evaluate (no eval set)", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
