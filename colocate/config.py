"""Run configuration: YAML files (composed with `base:`), `--section.key=value` overrides, validation.

The schema (one dataclass per component, each field documented) is `colocate.config_schema`; its
classes are importable from here too. `load_config` is the only entry: it merges YAML and
overrides, rejects unknown keys (naming the nearest valid one) and wrong types, then
`config_checks.validate` checks the values and the rules across keys. Everything here runs before
any model is built or any process group exists; a `ConfigError` ends the job with exit code 2 and
one line (see `train.py`).

A YAML file may start from another: `base: other.yaml` (relative to the file; chains allowed,
cycles refused). The base is applied first and the file over it, section by section and key by
key (a list is replaced whole), then the overrides. `configs/gpu-*.yaml` share `configs/gpu.yaml`.

This module imports nothing of colocate but `config_schema` and `config_checks`: every other
module may import it.

Deliberately absent: environment-variable magic, `exec`, registries. What a run used is written to
`<run_dir>/config.yaml` by the composition root.
"""
from __future__ import annotations

import dataclasses
import io
import os
import stat
import types
import typing
from typing import Any

import yaml

from colocate.config_checks import ConfigError, nearest_key, validate
from colocate.config_schema import (CheckpointConfig, Config, EngineConfig, EnvConfig, EvalConfig, LearnerConfig, LoraConfig,
                                    LossConfig, MetricsConfig, ModelConfig, RolloutConfig, SyncConfig, TopologyConfig,
                                    field_docs)

__all__ = ["ConfigError", "load_config", "parse_overrides", "to_dict", "save_config",
           "field_docs", "Config", "ModelConfig", "LoraConfig", "EngineConfig", "EnvConfig", "RolloutConfig",
           "LearnerConfig", "LossConfig", "SyncConfig", "TopologyConfig", "MetricsConfig", "CheckpointConfig",
           "EvalConfig"]


BASE_KEY = "base"
"""Top-level YAML key naming the file this one starts from."""
RETIRED_KEYS = {  # a key that left the code after it was measured -> why (profiles/HISTORY.md has its figures)
    "engine.kv_cache_dtype": "vLLM's FP8 KV cache ran slower than FP8 weights alone",
    "engine.parallel_sampling": "one request with n samples ran slower than n requests",
    "rollout.refill": "replacing completed groups at once under drain ran slower",
    "topology.mps": "CUDA MPS ran the one-GPU presets slower than time slices",
}


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check (and for CLI strings, parse) one value against its field type."""
    origin = typing.get_origin(annotation) or annotation
    if origin is types.UnionType:  # `int | str`: a number, or a word its check names (micro_batch_tokens: auto)
        names = " or ".join(a.__name__ for a in typing.get_args(annotation))
        try:
            value = yaml.safe_load(value) if isinstance(value, str) else value
        except yaml.YAMLError:
            raise ConfigError(f"{where}: expected {names}, got {value!r}") from None
        if not isinstance(value, typing.get_args(annotation)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected {names}, got {type(value).__name__} {value!r}")
        return value
    if isinstance(value, str) and annotation is float:
        # Any float notation, on the command line and in YAML alike: YAML 1.1 reads `1e-6` and `3e-3`
        # as strings (it wants `1.0e-6`), Python's float() takes them, `.5` and `1_000.0` too.
        try:
            return float(value.strip())
        except ValueError:
            parsed = yaml.safe_load(value)  # YAML's own spellings: .nan, .inf
            if isinstance(parsed, float):
                return parsed
            raise ConfigError(f"{where}: expected float, got str {value!r}") from None
    if isinstance(value, str) and annotation is not str and origin is not list:
        # Overrides arrive as strings: parse them as YAML scalars ("3" -> 3, "true" -> True), or a
        # flow mapping (env.options), its aliases bounded as in a file
        try:
            value = _load_yaml(io.StringIO(value), where)
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is list:
        if isinstance(value, str):  # a,b or [a,b] (what YAML would write)
            text = value.strip()
            text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
            value = [v.strip() for v in text.split(",") if v.strip()]
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
        if where in RETIRED_KEYS:
            raise ConfigError(f"'{where}' left colocate ({RETIRED_KEYS[where]}; profiles/HISTORY.md): delete it")
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one
    silently: `learner: {lr: 0.003, lr: 30.0}` would train at 30)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                break
            if first is not key_node:
                raise ConfigError(f"{key_node.start_mark.name}: key {key!r} is given twice (line "
                                  f"{first.start_mark.line + 1} and line {key_node.start_mark.line + 1}); keep one")
        return super().construct_mapping(node, deep=deep)


MAX_YAML_VALUES = 100_000
"""Most values a config file may hold once its aliases are expanded: a shipped preset holds a few
hundred, and an alias bomb (each anchor naming the one before it several times) holds billions,
which copying the config (`dataclasses.asdict`, the YAML echo) would expand."""

FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
              (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def check_config_file(path: str, named_by: str | None) -> None:
    """`path` is a regular file: else one line saying what it is (missing, a directory, a device)."""
    whose = f" (the base of {named_by})" if named_by else ""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise ConfigError(f"config file not found: {path}{whose}") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in FILE_KINDS if test(mode)), "not a regular file")
        raise ConfigError(f"{path}{whose} is {kind}, not a regular file (a YAML config file is expected)")


def expanded_values(node, counted: dict, path: str) -> int:
    """Values under a composed YAML node with every alias expanded (each node counted once per use);
    ConfigError beyond MAX_YAML_VALUES or for an alias inside itself."""
    if id(node) in counted:
        if counted[id(node)] is None:
            raise ConfigError(f"{path}: a YAML alias refers to a node that contains it (a config has no cycles)")
        return counted[id(node)]
    counted[id(node)] = None  # in progress
    children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
        node.value if isinstance(node, yaml.SequenceNode) else []
    total = 1
    for child in children:
        total += expanded_values(child, counted, path)
        if total > MAX_YAML_VALUES:
            raise ConfigError(f"{path}: its YAML aliases expand to more than {MAX_YAML_VALUES:,} values (an alias "
                              "bomb?); a config holds a few hundred")
    counted[id(node)] = total
    return total


def _load_yaml(f, path: str):
    """The document of an open YAML file, its aliases' expansion bounded (`expanded_values`)."""
    loader = _UniqueKeyLoader(f)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded_values(node, {}, path)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _read_yaml(path: str, named_by: str | None) -> dict:
    """One YAML file's top-level mapping (its `base:` key included); a key given twice is an error."""
    check_config_file(path, named_by)
    try:
        with open(path, encoding="utf-8") as f:
            data = _load_yaml(f, path)
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file (a YAML config is expected)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        raise ConfigError(f"{path}: is empty (or only comments): a config holds at least one section; `{{}}` "
                          "means all the defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def config_chain(path: str) -> list[tuple[str, dict]]:
    """[(file, its sections)] from the root base to `path` itself, following `base:` keys.

    A base path is relative to the file naming it. A file reached twice is a cycle (refused)."""
    chain, seen, named_by = [], [], None
    while path is not None:
        real = os.path.realpath(path)
        if real in seen:
            cycle = " -> ".join([p for p, _ in chain] + [path])
            raise ConfigError(f"config base cycle: {cycle} (each file names the next as its base)")
        seen.append(real)
        data = _read_yaml(path, named_by)
        has_base, base = BASE_KEY in data, data.pop(BASE_KEY, "")
        if has_base and (not isinstance(base, str) or not base):
            raise ConfigError(f"{path}: base: expected a file name, got {base!r}")
        chain.append((path, data))
        named_by, path = path, (os.path.normpath(os.path.join(os.path.dirname(path), base)) if base else None)
    return chain[::-1]


def without_retired(data: dict) -> dict:
    """A run's saved config.yaml without the keys that have left the code since it was written (it
    holds every key of its day, at its value then): what `--run` reads stays readable."""
    out = {}
    for section, values in data.items():
        if isinstance(values, dict):
            values = {k: v for k, v in values.items() if f"{section}.{k}" not in RETIRED_KEYS}
        out[section] = values
    return out


def load_config(path: str | None = None, overrides: dict | None = None, *, world_size: int | None = None,
                saved_run: bool = False) -> Config:
    """YAML file over its bases, then overrides (nested dict, string leaves allowed), then `validate`.
    `saved_run`: the file is a run's own config.yaml (`--run RUN`), whose retired keys are skipped;
    anywhere else a retired key is refused, saying why it left."""
    cfg = Config()
    for file, data in config_chain(path) if path else []:
        try:
            _merge(cfg, without_retired(data) if saved_run else data, "")
        except ConfigError as e:
            raise ConfigError(f"{file}: {e}") from None
    if overrides:
        _merge(cfg, overrides, "")
    validate(cfg, world_size=world_size)
    return cfg


def sampling_lag(cfg: Config) -> int:
    """How many versions behind the learner a batch may start sampling (`rollout/loop.py`).

    Without oversampling it is the budget itself: batch k waits for version >= k - max_policy_lag
    and is trained at step k. With oversampling, a group still in play when its batch ships is
    trained with a later batch, at least one step later, so the batch waits for one version
    fresher than the budget (lag - 1): groups trained with their own batch are lag - 1 behind,
    groups carried over one batch exactly lag, and only those carried twice are dropped. In-flight
    updates (`rollout.update=inflight`) carry requests across batches the same way: lag - 1."""
    lag = cfg.learner.max_policy_lag
    carries = cfg.rollout.oversample_groups > 0 or cfg.rollout.update == "inflight"
    return lag - 1 if carries else lag  # `validate` keeps lag >= 2 (oversampling) / >= 1 (inflight) there


def eval_enabled(cfg: Config) -> bool:
    """Held-out evaluation runs at all: inference rank 0 then sends its results to learner rank 0
    at the end of the run (both sides know it from the config alone)."""
    return cfg.eval.every > 0 or cfg.eval.at_end


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config (atomically: temp file + rename)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)
