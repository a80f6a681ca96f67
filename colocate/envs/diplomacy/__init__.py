"""Diplomacy (`diplomacy` package, 7 powers) behind the `Env` protocol.

    game.py    fork, legal orders once per phase, engine-format orders, state cache (JSON lines)
    prompt.py  compact prompt (instruction | board | own part), slots and constraint per power
    orders.py  completion text -> legal orders (lenient, never raises, counts what it drops)
    env.py     DiplomacyEnv: groups of forked continuations, horizon, stall stop, reward formula

`prompt.corpus()` is the text the embedded tokenizer is trained on; bump `prompt.CORPUS_VERSION` whenever
the prompt or order format changes (it keys the cached tokenizer).
"""
from __future__ import annotations

from colocate.envs.diplomacy.env import DiplomacyEnv, DiplomacySettings, power_rewards, random_legal_completion
from colocate.envs.diplomacy.game import StateCacheError, fork_game, load_state_cache
from colocate.envs.diplomacy.prompt import CORPUS_VERSION, corpus

__all__ = ["CORPUS_VERSION", "DiplomacyEnv", "DiplomacySettings", "StateCacheError", "corpus", "fork_game",
           "load_state_cache", "power_rewards", "random_legal_completion"]
