"""Environments behind the `Env` protocol (`base.py`): which class `env.name` names (`BUILTIN`, or a
class of the user's by path, "my_pkg.my_env:MyEnv", built with its `from_config`: docs/envs.md), the
run's env (`make_env`), the tokenizer corpus per env, and the env's own checks of a run: `check_env`
(its `check` and `preflight` hooks, before any model) and `check_env_resume` (its `check_resume`).
"""
from __future__ import annotations

import hashlib
import importlib

from colocate.config_checks import ConfigError, is_object_path, nearest_key
from colocate.envs.base import Env
from colocate.envs.checks import ENV_KEYS, check_key_rules, is_agent
from colocate.envs.processes import check_processes, check_resume_processes

BUILTIN = {
    "arithmetic": "colocate.envs.arithmetic:ArithmeticEnv",
    "diplomacy": "colocate.envs.diplomacy:DiplomacyEnv",
    "dataset": "colocate.envs.dataset:DatasetEnv",
}
"""env.name -> the built-in class it names; env.name is one of these or a class by path (`checked_class`)."""


def env_class(name: str) -> type[Env]:
    """The class `env.name` names; a custom one must subclass `Env`."""
    if name in BUILTIN:
        module, _, attr = BUILTIN[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    from colocate.objects import ObjectPathError, load_object
    cls = load_object(name)
    if not isinstance(cls, type) or not issubclass(cls, Env):
        raise ObjectPathError(f"{name!r} is not a subclass of colocate.envs.base.Env (docs/envs.md)")
    return cls


def env_corpus(cfg):
    """(cache key, function returning the texts) the embedded tokenizer is trained on for this env."""
    cls = env_class(cfg.env.name)
    key = cls.corpus_key(cfg)
    if key is not None:
        return key, lambda: cls.corpus(cfg)
    texts = cls.corpus(cfg)  # keyed by the text itself
    return f"custom-{hashlib.sha1(chr(0).join(texts).encode()).hexdigest()[:12]}", lambda: texts


def env_type(cfg) -> type[Env]:
    """The class a run's env is built from (`make_env`): `env.name`'s, or agent episodes over the
    dataset env's rows when it has env.tools or env.environment."""
    if cfg.env.name == "dataset" and is_agent(cfg):
        from colocate.envs.agent import AgentEnv
        return AgentEnv
    return env_class(cfg.env.name)


def make_env(cfg, tokenizer, seed: int, processes: int = 0) -> Env:
    """The run's env; with `processes` > 0, that many copies in worker processes (`EnvProcesses`)."""
    cls = env_type(cfg)
    if processes > 0:
        from colocate.envs.processes import EnvProcesses
        print(f"colocate: env {cls.__name__} in {processes} worker processes (env.processes)", flush=True)
        return EnvProcesses(cls, cfg, tokenizer, seed, processes)
    return cls.from_config(cfg, tokenizer, seed=seed)


def env_facts(cfg) -> dict[str, int]:
    """What the env states about its requests, for sizing an engine (`vllm_settings.engine_settings`
    takes them; the engine never sees the env): the prompt-length bound, requests per live group."""
    cls = env_type(cfg)
    return {"prompt_bound": cls.prompt_bound(cfg), "requests_per_group": cls.requests_per_group(cfg)}


def check_env(cfg, *, outside_world: bool = True) -> None:
    """The env's own rules for this run, one `ConfigError` line each: the class `env.name` names
    imports (a user's follows the protocol, `envs/protocol.py`), its `check(cfg)`, env.processes
    against the rollout mode, then (`outside_world`) its `preflight(cfg)`. A built-in and a user's
    class are checked the same way; `preflight.preflight` and `eval` run this before any model."""
    cls = checked_class(cfg)
    check_key_rules(cfg, ENV_KEYS)
    cls.check(cfg)
    check_processes(cfg)
    if outside_world:
        cls.preflight(cfg)


def checked_class(cfg) -> type[Env]:
    """`env_class(env.name)`, its failures as `ConfigError`; env.name is a built-in's or a path, and
    a user's class also fits `Env` by signature and takes `env.options`."""
    from colocate.objects import ObjectPathError
    name = cfg.env.name
    if name not in BUILTIN and not is_object_path(str(name)):
        raise ConfigError(f"env.name={name!r} is not one of {', '.join(map(repr, BUILTIN))}; did you mean "
                          f"{nearest_key(str(name), list(BUILTIN))!r}? (or a class by path: 'my_pkg.my_env:MyEnv')")
    try:
        cls = env_class(cfg.env.name)
    except ObjectPathError as e:
        raise ConfigError(f"env.name: {e}") from None
    if cfg.env.name in BUILTIN:
        return cls
    from colocate.envs.protocol import EnvProtocolError, check_env_class
    try:
        check_env_class(cls, cfg.env.options)
    except EnvProtocolError as e:
        raise ConfigError(f"env.name={cfg.env.name!r}: {e}") from None
    return cls


def check_env_resume(saved: list[dict], cfg) -> None:
    """Whether this run can continue from the env resume states `saved` (one per inference rank that
    kept one): the env's `check_resume`, then the number of env copies; raises `base.ResumeError`."""
    env_class(cfg.env.name).check_resume(saved, cfg)
    check_resume_processes(saved, cfg)
