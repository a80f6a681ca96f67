"""Evaluation against fixed opponents: does the policy play Diplomacy better than the bots?

For each opponent kind (`bots.py`) and each of the 7 powers, `eval.games` games start at the
opening; the policy plays that power and six bots of the kind play the others, for
`eval.horizon_years` years (S1901M with horizon 2 ends on reaching S1903M) or until the game ends.
The policy samples at `eval.temperature` with the training prompt and legal-order constraint
(`DiplomacyEnv.request`). Each round advances every live game by one phase: the prompts of all
games waiting on the policy go to the engine in one `generate` call; the bots decide on the host.

Per opponent kind, over its 7 x `eval.games` games (the policy's power each time):
    mean_centres   supply centres at the end          (95 %: mean +- 1.96 standard errors)
    mean_gain      centres at the end - at the start  (same interval)
    survival_rate  still holds a unit or a centre      (95 %: Wilson score interval)
    win_rate       most centres at the end; a tie for most splits the win among the tied
                   (Wilson on the mean share)
    games, invalid_order_rate (policy slots left without a legal order)
Names are `diplomacy/<opponent>/<metric>`, bounds `<metric>_lo` / `<metric>_hi`. With `out_dir`,
each game goes to `<out_dir>/<opponent>/<POWER>-<k>.json` (saved game) and `.svg` (final board),
and the per-game results with the metrics to `<out_dir>/results.json`.

Games are seeded: the bots of game (opponent, power, k) draw from their own RNG, so a
deterministic policy (temperature 0) replays the same games.
"""
from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict, dataclass, field

from colocate.envs.diplomacy import game as dg
from colocate.envs.diplomacy.archive import save_game
from colocate.envs.diplomacy.bots import Bot, make_bot
from colocate.envs.diplomacy.prompt import PowerOrders, board_lines, power_orders

Z95 = 1.96


@dataclass
class EvalGame:
    opponent: str
    power: str
    """The power the policy plays."""
    index: int
    game: object
    rng: random.Random
    """The bots' RNG for this game."""
    end_key: tuple[int, int, int]
    start_centres: int
    slots: int = 0
    invalid: int = 0

    @property
    def name(self) -> str:
        return f"{self.power}-{self.index}"

    def is_over(self) -> bool:
        return self.game.is_game_done or dg.phase_key(self.game.get_current_phase()) >= self.end_key


@dataclass
class GameResult:
    opponent: str
    power: str
    index: int
    centres: int
    gain: int
    survived: bool
    win_share: float
    """1 / (powers tied for the most centres) if the policy's power is one of them, else 0."""
    final_phase: str
    all_centres: dict = field(default_factory=dict)


def new_games(opponents: list[str], games: int, horizon_years: int, seed: int = 0) -> list[EvalGame]:
    """Every (opponent, power, k) game at the opening; RNGs seeded by that triple and `seed`."""
    out = []
    for opponent in opponents:
        for power in dg.POWERS:
            for k in range(games):
                game = dg.new_game(game_id=f"eval-{opponent}-{power}-{k}")
                key = dg.phase_key(game.get_current_phase())
                out.append(EvalGame(opponent, power, k, game, random.Random(f"{seed}/{opponent}/{power}/{k}"),
                                    (key[0] + horizon_years, key[1], key[2]),
                                    len(game.powers[power].centers)))
    return out


class BotPolicy:
    """A bot in the policy's seat (baselines and tests: `greedy` against `random`)."""

    def __init__(self, kind: str):
        self.bot = make_bot(kind)

    def decide(self, asks: list[tuple[EvalGame, PowerOrders]]) -> list[list[str]]:
        return [self.bot.orders(g.game, orders, g.rng) for g, orders in asks]


class EnginePolicy:
    """The trained policy: one `engine.generate` for every game waiting on it."""

    def __init__(self, env, engine, temperature: float):
        self.env, self.engine, self.temperature = env, engine, temperature

    def decide(self, asks: list[tuple[EvalGame, PowerOrders]]) -> list[list[str]]:
        env = self.env
        requests = [env.request(env.tokens.encode("".join(board_lines(g.game))), orders, self.temperature)
                    for g, orders in asks]
        completions = self.engine.generate(requests) if requests else []
        out = []
        for (g, orders), completion in zip(asks, completions):
            parsed = env.parse(completion, orders)
            g.slots += orders.num_slots
            g.invalid += parsed.num_invalid
            out.append(parsed.orders)
        return out


def play(games: list[EvalGame], policy) -> None:
    """Play every game to its end, one phase of every live game per round."""
    bots: dict[str, Bot] = {}
    memo: dict[str, str] = {}  # engine_order's memo (one map)
    live = [g for g in games if not g.is_over()]
    while live:
        phase_orders = [power_orders(g.game, dg.legal_orders(g.game)) for g in live]
        asks = [(g, orders[g.power]) for g, orders in zip(live, phase_orders) if g.power in orders]
        answers = {id(g): chosen for (g, _), chosen in zip(asks, policy.decide(asks))}
        for g, orders in zip(live, phase_orders):
            bot = bots.setdefault(g.opponent, make_bot(g.opponent))
            for power, power_view in orders.items():
                chosen = answers[id(g)] if power == g.power else bot.orders(g.game, power_view, g.rng)
                g.game.set_orders(power, [dg.engine_order(o, g.game.map, memo) for o in chosen], expand=False)
            g.game.process()
        live = [g for g in live if not g.is_over()]


def result(g: EvalGame) -> GameResult:
    centres = dg.centre_counts(g.game)
    mine, best = centres[g.power], max(centres.values())
    tied = sum(1 for c in centres.values() if c == best)
    power = g.game.powers[g.power]
    return GameResult(g.opponent, g.power, g.index, mine, mine - g.start_centres,
                      bool(power.units or power.centers), 1.0 / tied if mine == best else 0.0,
                      g.game.get_current_phase(), centres)


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, lo, hi): normal 95 % interval of the mean (a point for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    half = Z95 * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, mean - half, mean + half


def wilson_interval(rate: float, n: int) -> tuple[float, float]:
    """95 % Wilson score interval of a rate observed over n games (stays inside [0, 1])."""
    z2 = Z95 * Z95
    centre = (rate + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(rate * (1 - rate) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(results: list[GameResult], games: list[EvalGame]) -> dict[str, float]:
    """The module docstring's metrics, per opponent kind."""
    out: dict[str, float] = {}
    for opponent in dict.fromkeys(r.opponent for r in results):
        mine = [r for r in results if r.opponent == opponent]
        prefix, n = f"diplomacy/{opponent}/", len(mine)
        for name, values in (("mean_centres", [r.centres for r in mine]), ("mean_gain", [r.gain for r in mine])):
            out[prefix + name], out[prefix + name + "_lo"], out[prefix + name + "_hi"] = mean_interval(values)
        for name, values in (("survival_rate", [float(r.survived) for r in mine]),
                             ("win_rate", [r.win_share for r in mine])):
            rate = sum(values) / n
            out[prefix + name] = rate
            out[prefix + name + "_lo"], out[prefix + name + "_hi"] = wilson_interval(rate, n)
        out[prefix + "games"] = float(n)
        played = [g for g in games if g.opponent == opponent]
        out[prefix + "invalid_order_rate"] = sum(g.invalid for g in played) / max(sum(g.slots for g in played), 1)
    return out


def write_outputs(games: list[EvalGame], results: list[GameResult], metrics: dict, out_dir: str) -> None:
    """Saved games and final boards per game, then `results.json` (atomically)."""
    boards: dict = {}
    for g in games:
        save_game(g.game, os.path.join(out_dir, g.opponent, g.name), boards)
    path = os.path.join(out_dir, "results.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"metrics": metrics, "games": [asdict(r) for r in results]}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def evaluate(env, engine, eval_cfg, out_dir: str | None = None, seed: int = 0) -> dict[str, float]:
    """`Env.evaluate` for Diplomacy: the engine's policy against every kind in `eval_cfg.opponents`."""
    games = new_games(list(eval_cfg.opponents), eval_cfg.games, eval_cfg.horizon_years, seed)
    play(games, EnginePolicy(env, engine, eval_cfg.temperature))
    results = [result(g) for g in games]
    metrics = summarize(results, games)
    if out_dir:
        write_outputs(games, results, metrics, out_dir)
    return metrics
