"""Diplomacy (`diplomacy` package, 7 powers) behind the `Env` protocol.

    game.py    fork, legal orders once per phase, engine-format orders, state cache (JSON lines)
    prompt.py  compact prompt (instruction | board | own part), slots and constraint per power
    orders.py  completion text -> legal orders (lenient, never raises, counts what it drops)
    env.py     DiplomacyEnv: groups of forked continuations, horizon, stall stop, reward formula

`corpus()` is the text the embedded tokenizer is trained on; bump CORPUS_VERSION whenever the
prompt or order format changes (it keys the cached tokenizer).
"""
from __future__ import annotations

import random

from colocate.envs.diplomacy.env import DiplomacyEnv, power_rewards, random_legal_completion
from colocate.envs.diplomacy.game import StateCacheError, fork_game, load_state_cache
from colocate.envs.diplomacy.prompt import INSTRUCTION

CORPUS_VERSION = "2"

__all__ = ["CORPUS_VERSION", "DiplomacyEnv", "StateCacheError", "corpus", "fork_game", "load_state_cache",
           "power_rewards", "random_legal_completion"]


def corpus(num_games: int = 8, last_year: int = 1910, seed: int = 0) -> list[str]:
    """Prompts and completions of seeded random games: every power's prompt in every phase."""
    from colocate.envs.diplomacy import game as dg
    from colocate.envs.diplomacy.prompt import board_lines, completion_text, own_lines, power_orders
    rng = random.Random(seed)
    texts = []
    for _ in range(num_games):
        game = dg.new_game()
        while not game.is_game_done and dg.phase_key(game.get_current_phase())[0] <= last_year:
            board = "".join(board_lines(game))
            for power, orders in power_orders(game, dg.legal_orders(game)).items():
                chosen = [rng.choice(c) for c in orders.choices]
                texts.append(INSTRUCTION + board + "".join(own_lines(orders)) + completion_text(chosen))
                game.set_orders(power, chosen)
            game.process()
    return texts
