"""Environments behind the `Env` protocol (`base.py`): `make_env` and the tokenizer corpus per env.

`env.name` is a built-in (arithmetic, diplomacy, dataset) or a class of the user's by path,
"my_pkg.my_env:MyEnv", built with its `from_config` (docs/envs.md).
"""
from __future__ import annotations

import hashlib

from colocate.envs.base import Env


def env_class(name: str) -> type[Env]:
    """The class `env.name` names; a custom one must subclass `Env`."""
    if name == "dataset":
        from colocate.envs.dataset import DatasetEnv
        return DatasetEnv
    from colocate.objects import ObjectPathError, load_object
    cls = load_object(name)
    if not isinstance(cls, type) or not issubclass(cls, Env):
        raise ObjectPathError(f"{name!r} is not a subclass of colocate.envs.base.Env (docs/envs.md)")
    return cls


def env_corpus(cfg):
    """(cache key, function returning the texts) the embedded tokenizer is trained on for this env."""
    if cfg.env.name == "arithmetic":
        from colocate.envs import arithmetic
        return f"arithmetic-{cfg.env.max_operand}", lambda: arithmetic.corpus(cfg.env.max_operand)
    if cfg.env.name == "diplomacy":
        from colocate.envs import diplomacy
        return f"diplomacy-{diplomacy.CORPUS_VERSION}", diplomacy.corpus
    if cfg.env.name == "dataset":
        from colocate.envs import dataset
        return dataset.corpus_key(cfg), lambda: dataset.corpus(cfg)
    texts = env_class(cfg.env.name).corpus(cfg)  # a custom env: keyed by its text itself
    return f"custom-{hashlib.sha1(chr(0).join(texts).encode()).hexdigest()[:12]}", lambda: texts


def env_type(cfg) -> type[Env]:
    """The class a run's env is built from (`make_env`)."""
    if cfg.env.name == "arithmetic":
        from colocate.envs.arithmetic import ArithmeticEnv
        return ArithmeticEnv
    if cfg.env.name == "diplomacy":
        from colocate.envs.diplomacy import DiplomacyEnv
        return DiplomacyEnv
    if cfg.env.name == "dataset" and (cfg.env.tools or cfg.env.environment):  # multi-turn tool episodes
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
