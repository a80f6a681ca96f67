"""Environments behind the `Env` protocol (`base.py`): `make_env` and the tokenizer corpus per env."""
from __future__ import annotations

from colocate.envs.base import Env


def env_corpus(cfg):
    """(cache key, function returning the texts) the embedded tokenizer is trained on for this env."""
    if cfg.env.name == "arithmetic":
        from colocate.envs import arithmetic
        return f"arithmetic-{cfg.env.max_operand}", lambda: arithmetic.corpus(cfg.env.max_operand)
    if cfg.env.name == "diplomacy":
        from colocate.envs import diplomacy
        return f"diplomacy-{diplomacy.CORPUS_VERSION}", diplomacy.corpus
    raise ValueError(f"unknown env {cfg.env.name!r}")


def make_env(cfg, tokenizer, seed: int) -> Env:
    if cfg.env.name == "arithmetic":
        from colocate.envs.arithmetic import ArithmeticEnv
        return ArithmeticEnv(tokenizer, group_size=cfg.rollout.group_size, max_operand=cfg.env.max_operand,
                             max_new_tokens=cfg.engine.max_new_tokens, temperature=cfg.engine.temperature,
                             use_constraint=cfg.env.use_constraint, seed=seed)
    if cfg.env.name == "diplomacy":
        from colocate.envs.diplomacy import DiplomacyEnv
        return DiplomacyEnv.from_config(cfg, tokenizer, seed=seed)
    raise ValueError(f"unknown env {cfg.env.name!r}")
