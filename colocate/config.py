"""Run configuration: YAML files, `--section.key=value` overrides, validation.

The schema (one dataclass per component, each field documented) is `colocate.config_schema`; its
classes are importable from here too. `load_config` is the only entry: it merges YAML and
overrides, rejects unknown keys (naming the nearest valid one) and wrong types, then `validate`
runs the cross-field checks. Everything here runs before any model is built or any process group
exists; a `ConfigError` ends the job with exit code 2 and one line (see `train.py`).

Deliberately absent: environment-variable magic, `exec`, registries. What a run used is written to
`<run_dir>/config.yaml` by the composition root.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any

import yaml

from colocate.config_schema import (CheckpointConfig, Config, EngineConfig, EnvConfig, LearnerConfig, LoraConfig,
                                    LossConfig, MetricsConfig, ModelConfig, RolloutConfig, SyncConfig, TopologyConfig,
                                    field_docs)
from colocate.engine.vllm_settings import CUDAGRAPH_MODES, LORA_MODES  # no vLLM import there

__all__ = ["ConfigError", "load_config", "parse_overrides", "validate", "resolve_roles", "to_dict", "save_config",
           "field_docs", "Config", "ModelConfig", "LoraConfig", "EngineConfig", "EnvConfig", "RolloutConfig",
           "LearnerConfig", "LossConfig", "SyncConfig", "TopologyConfig", "MetricsConfig", "CheckpointConfig"]


class ConfigError(ValueError):
    """A bad configuration: the message is one line a user can act on."""


_CHOICES = {
    ("model", "shape"): ("tiny", "qwen2.5-0.5b", "qwen2.5-7b"),
    ("model", "dtype"): ("float32", "bfloat16"),
    ("engine", "kind"): ("auto", "hf", "vllm"),
    ("engine", "lora_mode"): LORA_MODES,
    ("engine", "cudagraph_mode"): CUDAGRAPH_MODES,
    ("env", "name"): ("arithmetic", "diplomacy"),
    ("loss", "norm"): ("grpo", "dapo", "dr_grpo"),
    ("loss", "impl"): ("auto", "triton", "torch"),
    ("learner", "attention"): ("auto", "varlen", "sdpa"),
    ("sync", "backend"): ("auto", "nccl", "gloo"),
    ("sync", "fanout"): ("broadcast", "per_engine"),
}


def nearest_key(key: str, valid: list[str]) -> str:
    """The valid key closest to a misspelt one (config keys; the loss kernel's launch keys)."""
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return match[0] if match else valid[0]


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check (and for CLI strings, parse) one value against its field type."""
    origin = typing.get_origin(annotation) or annotation
    if isinstance(value, str) and annotation is not str and origin is not list:
        # Overrides arrive as strings: parse them as YAML scalars ("3" -> 3, "true" -> True).
        value = yaml.safe_load(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return value
    ok = isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    return value


def _merge(section: Any, values: dict, path: str) -> None:
    hints = typing.get_type_hints(type(section))
    names = [f.name for f in dataclasses.fields(section)]
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            raise ConfigError(f"unknown config key '{where}'; did you mean "
                              f"'{(path + '.') if path else ''}{nearest_key(key, names)}'?")
        current = getattr(section, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping of keys, got {value!r}")
            _merge(current, value, where)
        else:
            setattr(section, key, _coerce(value, hints[key], where))


def parse_overrides(argv: list[str]) -> tuple[str | None, dict, bool]:
    """Split `--config PATH`, `--resume` and `--a.b=value` arguments into (path, nested dict, resume)."""
    config_path, nested, resume = None, {}, False
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            config_path = next(it, None)
            continue
        if arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
            continue
        if arg == "--resume":
            resume = True
            continue
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"cannot parse argument {arg!r}; expected --section.key=value")
        key, sep, value = arg[2:].partition("=")
        if not sep:
            value = next(it, None)
            if value is None:
                raise ConfigError(f"argument {arg!r} has no value")
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config_path, nested, resume


def load_config(path: str | None = None, overrides: dict | None = None, *, world_size: int | None = None) -> Config:
    """YAML file, then overrides (nested dict, string leaves allowed), then `validate`."""
    cfg = Config()
    if path:
        if not os.path.exists(path):
            raise ConfigError(f"config file not found: {path}")
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        _merge(cfg, data, "")
    if overrides:
        _merge(cfg, overrides, "")
    validate(cfg, world_size=world_size)
    return cfg


def resolve_roles(cfg: Config, world_size: int) -> tuple[int, int]:
    """(num_inference, num_learners) for this world size; default half and half, 1 + 1 for 2 processes."""
    t = cfg.topology
    num_inference = t.num_inference or max(1, world_size // 2)
    num_learners = t.num_learners or (world_size - num_inference)
    return num_inference, num_learners


def validate(cfg: Config, *, world_size: int | None = None) -> None:
    """Cross-field checks. Each failure is one line naming the fields involved."""
    for (section, key), allowed in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"{section}.{key}={value!r} is not one of {', '.join(allowed)}")
    r = cfg.rollout
    if r.group_size < 2:
        raise ConfigError(f"rollout.group_size={r.group_size}: GRPO needs at least 2 samples per group")
    if r.batch_size % r.group_size != 0:
        raise ConfigError(f"rollout.group_size={r.group_size} does not divide rollout.batch_size={r.batch_size}")
    if r.groups_per_step * r.group_size != r.batch_size:
        raise ConfigError(f"rollout.batch_size={r.batch_size} must equal rollout.groups_per_step * rollout.group_size "
                          f"= {r.groups_per_step * r.group_size}")
    if cfg.learner.max_policy_lag < 0:
        raise ConfigError(f"learner.max_policy_lag={cfg.learner.max_policy_lag} must be >= 0")
    if r.oversample_groups < 0:
        raise ConfigError(f"rollout.oversample_groups={r.oversample_groups} must be >= 0")
    if r.oversample_groups > 0 and cfg.learner.max_policy_lag < 2:
        raise ConfigError(f"rollout.oversample_groups={r.oversample_groups} needs learner.max_policy_lag >= 2: "
                          "a group carried over to the next batch is trained a step later, so batches start one "
                          "version fresher than the budget (lag 1 would make rollouts wait for every learner step)")
    if cfg.learner.num_steps < 1:
        raise ConfigError("learner.num_steps must be >= 1")
    if cfg.loss.eps_low < 0 or cfg.loss.eps_high < 0 or cfg.loss.beta < 0:
        raise ConfigError("loss.eps_low, loss.eps_high and loss.beta must be >= 0")
    if cfg.engine.jump_forward < 0:
        raise ConfigError(f"engine.jump_forward={cfg.engine.jump_forward} must be >= 0 (0 = off)")
    if cfg.engine.jump_forward > 0 and cfg.engine.cudagraph_mode:
        raise ConfigError("engine.cudagraph_mode cannot be set with engine.jump_forward, which captures its own "
                          "piecewise graphs")
    if cfg.engine.max_capture_tokens < 0:
        raise ConfigError(f"engine.max_capture_tokens={cfg.engine.max_capture_tokens} must be >= 0")
    if cfg.learner.prefetch_blocks < 0:
        raise ConfigError(f"learner.prefetch_blocks={cfg.learner.prefetch_blocks} must be >= 0 (0 = FSDP2's own)")
    if cfg.engine.temperature <= 0:
        raise ConfigError(f"engine.temperature={cfg.engine.temperature} must be > 0")
    if cfg.model.path and not os.path.isdir(cfg.model.path):
        raise ConfigError(f"model.path={cfg.model.path!r} is not a local directory (nothing is downloaded)")
    if cfg.model.path and not os.path.exists(os.path.join(cfg.model.path, "config.json")):
        raise ConfigError(f"model.path={cfg.model.path!r} has no config.json: not an HF model directory")
    if world_size is not None:
        num_inference, num_learners = resolve_roles(cfg, world_size)
        if num_inference < 1 or num_learners < 1 or num_inference + num_learners != world_size:
            raise ConfigError(
                f"topology: {num_inference} inference + {num_learners} learner ranks do not fit world size "
                f"{world_size} (need at least 1 of each, summing to the world size)")
        if r.groups_per_step < num_inference:  # uneven shares are fine (Topology.share); empty ones are not
            raise ConfigError(f"rollout.groups_per_step={r.groups_per_step} leaves some of the {num_inference} "
                              "inference ranks without a group")
        # learners may get shards one sequence apart (transport.shard_batch) and run as many
        # micro-batches as the busiest one, so the batch need not divide by the learner count


def sampling_lag(cfg: Config) -> int:
    """How many versions behind the learner a batch may start sampling (`rollout/loop.py`).

    Without oversampling it is the budget itself: batch k waits for version >= k - max_policy_lag
    and is trained at step k. With oversampling, a group still in play when its batch ships is
    trained with a later batch, at least one step later, so the batch waits for one version
    fresher than the budget (lag - 1): groups trained with their own batch are lag - 1 behind,
    groups carried over one batch exactly lag, and only those carried twice are dropped."""
    lag = cfg.learner.max_policy_lag
    return lag - 1 if cfg.rollout.oversample_groups > 0 else lag  # `validate` keeps lag >= 2 there


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config (atomically: temp file + rename)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)
