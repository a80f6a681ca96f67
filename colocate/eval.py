"""`colocate eval --config CFG [--checkpoint DIR | --run RUN] [--out FILE] [--device cpu] [--section.key=value ...]`

Held-out evaluation of a saved adapter, outside a training run: the same `Env.evaluate` the
inference rank calls every `eval.every` steps, on the HF reference engine in this one process.
`--checkpoint DIR` is any adapter: a run's `adapter/` (written at the end of every run), an
exported one (`colocate export` without `--merge`), or a checkpoint's `step-*` directory.
`--run RUN` evaluates `RUN/adapter` with `RUN/config.yaml` (each unless given). Without either
the base model is scored (adapter version 0, which changes nothing).

Where it writes: `<run>/evals/<name>/metrics.json` with the env's samples beside it (`<run>` is
`--run` or `metrics.run_dir`; `<name>` the adapter directory's name, or `base`), or `--out FILE`.
`evals/` is not part of a run: `colocate train` neither refuses a directory for it nor deletes it
with `--overwrite`, and each result names the adapter it scored by its hash. The metrics go to
stdout as JSON, the line saying where they went to stderr.

Bad input is one line and exit code 2 before any model is built: the config, the output path, and
the adapter (verified against its manifest: every file's hash, the base model's shape and weight
fingerprint, the LoRA shapes of this config).
"""
from __future__ import annotations

import json
import os
import sys
import time

from colocate.config import Config, ConfigError, load_config, parse_overrides
from colocate.jsonfile import write_atomic


def split_flags(argv: list[str]) -> tuple[list[str], dict]:
    """Our own flags (--checkpoint, --run, --out, --device) out of the config arguments."""
    flags, rest, it = {"checkpoint": "", "run": "", "out": "", "device": "cpu"}, [], iter(argv)
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


def load_eval_config(rest: list[str], flags: dict) -> Config:
    """The config (`--config`, or `--run`'s config.yaml); `--run` also names the adapter."""
    path, overrides, _ = parse_overrides(rest)
    run, saved_run = flags["run"], False
    if run:
        if not os.path.isfile(os.path.join(run, "config.yaml")):
            raise ConfigError(f"--run {run}: no config.yaml (not a run directory: metrics.run_dir of a run)")
        saved_run = path is None
        path = path or os.path.join(run, "config.yaml")
        flags["checkpoint"] = flags["checkpoint"] or os.path.join(run, "adapter")
    if path is None:
        raise ConfigError("--config FILE (or --run RUN) is required")
    return load_config(path, overrides, saved_run=saved_run)


def output_path(cfg: Config, flags: dict) -> str:
    """Where the metrics go (checked writable, nothing created): `--out`, else under `<run>/evals/`."""
    from colocate.preflight import check_writable_dir
    name = os.path.basename(os.path.normpath(flags["checkpoint"])) if flags["checkpoint"] else "base"
    out = flags["out"] or os.path.join(flags["run"] or cfg.metrics.run_dir, "evals", name, "metrics.json")
    if os.path.isdir(out):
        raise ConfigError(f"--out={out!r} is a directory (a file path for the metrics JSON is expected)")
    check_writable_dir(f"--out={out!r}", os.path.dirname(os.path.abspath(out)))
    return out


def check_adapter(cfg: Config, adapter: dict, tokenizer) -> None:
    """The adapter against this config's base model (shape, weights) and LoRA shapes, on the meta
    device: nothing is built."""
    from colocate.checkpoint import CheckpointError, check_adapter_matches, check_base
    from colocate.models import base_identity, build_policy, lora_state
    check_base(adapter["base"], base_identity(cfg.model, len(tokenizer)), adapter["path"])
    saved = (adapter["peft_config"]["r"], float(adapter["peft_config"]["lora_alpha"]))
    if saved != (cfg.lora.rank, cfg.lora.alpha):
        raise CheckpointError(f"{os.path.join(adapter['path'], 'adapter_config.json')}: the adapter has r={saved[0]}, "
                              f"lora_alpha={saved[1]:g}; this config has lora.rank={cfg.lora.rank}, lora.alpha="
                              f"{cfg.lora.alpha:g}: pass --lora.rank={saved[0]} --lora.alpha={saved[1]:g} "
                              "(or --run RUN: the run's own config)")
    check_adapter_matches(adapter["adapter"], lora_state(build_policy(cfg, tokenizer, "meta")), adapter["path"])


def configure(argv: list[str]) -> tuple[Config, dict, dict | None]:
    """Config, flags (with the output path) and the adapter (verified), or one line and exit code 2."""
    from colocate.checkpoint import CheckpointError, check_same_task, load_adapter
    from colocate.envs import env_corpus
    from colocate.models import load_tokenizer
    from colocate.envs import check_env
    from colocate.preflight import check_model_dir
    try:
        rest, flags = split_flags(argv)
        cfg = load_eval_config(rest, flags)
        check_model_dir(cfg.model.path)
        check_env(cfg)
        flags["out"] = output_path(cfg, flags)
        adapter = None
        if flags["checkpoint"]:
            adapter = load_adapter(flags["checkpoint"], cfg.checkpoint.trust_unverified)
            check_same_task(cfg, flags["checkpoint"])
            key, corpus_fn = env_corpus(cfg)
            check_adapter(cfg, adapter, load_tokenizer(cfg.model, corpus_fn, key))
    except (ConfigError, CheckpointError) as e:
        kind = "config" if isinstance(e, ConfigError) else "checkpoint"
        print(f"colocate: {kind} error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    return cfg, flags, adapter


def evaluate(cfg: Config, adapter: dict | None, *, device: str = "cpu", out_dir: str | None = None) -> dict:
    """Tokenizer, base model + adapter, HF engine, env -> the env's evaluation metrics."""
    from colocate.engine.hf import HFEngine
    from colocate.envs import env_corpus, make_env
    from colocate.models import build_policy, load_tokenizer
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    engine = HFEngine(build_policy(cfg, tokenizer, device), tokenizer, device=device, seed=cfg.rollout.seed)
    if adapter is not None:
        engine.load_lora(adapter["version"], adapter["adapter"])
    env = make_env(cfg, tokenizer, seed=cfg.rollout.seed * 1000)
    return {k: float(v) for k, v in env.evaluate(engine, cfg.eval, out_dir).items()}


def adapter_hash(path: str) -> str:
    """The BLAKE2b of the adapter's weights file: which adapter a result belongs to."""
    from colocate.checkpoint import file_digest
    return file_digest(os.path.join(path, "adapter_model.safetensors"))[1]


def main(argv: list[str] | None = None) -> dict:
    cfg, flags, adapter = configure(sys.argv[1:] if argv is None else argv)
    out = flags["out"]
    metrics = evaluate(cfg, adapter, device=flags["device"], out_dir=os.path.dirname(os.path.abspath(out)))
    result = {"checkpoint": flags["checkpoint"] or None, "env": cfg.env.name,
              "version": adapter["version"] if adapter else 0, "metrics": metrics,
              "adapter_blake2b": adapter_hash(flags["checkpoint"]) if adapter else None,
              "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_atomic(out, result)
    print(json.dumps(result, indent=2))
    print(f"colocate: eval wrote {out} (the env's samples beside it)", file=sys.stderr, flush=True)
    if not metrics:
        print(f"colocate: env {cfg.env.name} has nothing to evaluate (no eval set)", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
