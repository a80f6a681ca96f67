"""Evaluation against fixed opponents: the bots, seeded games, metrics, saved games and boards."""
import json
import os
import random

import pytest

from colocate.config import ConfigError, load_config
from colocate.config_schema import EvalConfig
from colocate.envs.diplomacy import DiplomacyEnv, DiplomacySettings, corpus
from colocate.envs.diplomacy import evaluate as ev
from colocate.envs.diplomacy import game as dg
from colocate.envs.diplomacy.archive import load_game
from colocate.envs.diplomacy.bots import BOTS, make_bot
from colocate.envs.diplomacy.prompt import BUILD, DISBAND, power_orders
from colocate.models import train_tokenizer
from tests.conftest import REPO


def bot_eval(policy: str, opponent: str, games: int, horizon: int, seed: int = 0) -> dict[str, float]:
    played = ev.new_games([opponent], games, horizon, seed)
    ev.play(played, ev.BotPolicy(policy))
    return ev.summarize([ev.result(g) for g in played], played)


def test_greedy_beats_random():
    """Seated in the policy's place against six random bots, greedy ends with more centres than a
    random bot in the same seat: the 95 % intervals of the mean do not overlap."""
    greedy = bot_eval("greedy", "random", games=4, horizon=2)
    rand = bot_eval("random", "random", games=4, horizon=2)
    key = "diplomacy/random/mean_centres"
    assert greedy["diplomacy/random/games"] == rand["diplomacy/random/games"] == 28
    assert greedy[key + "_lo"] > rand[key + "_hi"], (greedy[key], rand[key])
    assert greedy["diplomacy/random/mean_gain"] > rand["diplomacy/random/mean_gain"]


def test_bots_order_legally_in_every_kind_of_phase():
    """Every bot answers with orders from its slots' legal lists (builds and disbands on distinct
    sites) through movement, retreat and adjustment phases."""
    for kind in BOTS:
        bot, seen = make_bot(kind), set()
        for seed in range(3):
            game = dg.new_game()
            while dg.phase_key(game.get_current_phase())[0] < 1904:
                for power, orders in power_orders(game, dg.legal_orders(game)).items():
                    chosen = bot.orders(game, orders, random.Random(seed))
                    seen.add(orders.kind)
                    assert all(o in orders.slot_of for o in chosen), (kind, power, chosen)
                    assert len(chosen) <= orders.num_slots
                    if orders.kind in (BUILD, DISBAND):
                        sites = [o.split()[1][:3] for o in chosen if o != "WAIVE"]
                        assert len(sites) == len(set(sites))
                    game.set_orders(power, chosen)
                    assert not game.error, (kind, game.error)
                game.process()
        if kind != "hold":  # hold never loses or gains anything to adjust in 3 years of holding
            assert {"M", "B"} <= seen, (kind, seen)


def test_hold_bot_keeps_every_unit_in_place():
    game = dg.new_game()
    before = {p: sorted(game.powers[p].units) for p in dg.POWERS}
    hold = make_bot("hold")
    for power, orders in power_orders(game, dg.legal_orders(game)).items():
        game.set_orders(power, hold.orders(game, orders, random.Random(0)))
    game.process()
    assert {p: sorted(game.powers[p].units) for p in dg.POWERS} == before


def test_seeded_games_replay_and_the_policy_plays_only_its_power():
    a, b = bot_eval("random", "greedy", 1, 1, seed=5), bot_eval("random", "greedy", 1, 1, seed=5)
    assert a == b
    assert bot_eval("random", "greedy", 1, 1, seed=6) != a
    asked = []

    class Recorder(ev.BotPolicy):
        def decide(self, asks):
            asked.extend((g.power, orders.power) for g, orders in asks)
            return super().decide(asks)

    played = ev.new_games(["hold"], 1, 1)
    ev.play(played, Recorder("random"))
    assert asked and all(seat == power for seat, power in asked)
    assert {seat for seat, _ in asked} == set(dg.POWERS)


def test_win_share_splits_ties_for_the_most_centres():
    games = {g.power: g for g in ev.new_games(["hold"], 1, 1)}
    assert ev.result(games["RUSSIA"]).win_share == 1.0  # the only power with 4 centres
    assert ev.result(games["AUSTRIA"]).win_share == 0.0
    austria = games["AUSTRIA"]
    austria.game.set_centers("AUSTRIA", ["SER"])  # 4 centres each: Austria and Russia share the win
    assert ev.result(austria).win_share == 0.5 and ev.result(austria).gain == 1


def test_intervals_hold_their_estimate_and_shrink_with_games():
    mean, lo, hi = ev.mean_interval([3, 4, 5, 4])
    assert lo < mean == 4 < hi
    assert ev.mean_interval([2]) == (2, 2, 2)
    assert ev.mean_interval([3, 4, 5, 4] * 4)[2] - ev.mean_interval([3, 4, 5, 4] * 4)[1] < hi - lo
    for rate in (0.0, 0.3, 1.0):
        few, many = ev.wilson_interval(rate, 7), ev.wilson_interval(rate, 70)
        assert 0 <= few[0] <= rate <= few[1] <= 1 and few[1] - few[0] > many[1] - many[0]


def orders_by_phase(game) -> dict:
    return {str(phase): {p: sorted(o) for p, o in orders.items()} for phase, orders in game.order_history.items()}


def test_saved_game_reloads_in_the_package_and_the_board_is_written(tmp_path):
    played = ev.new_games(["greedy"], 1, 1)[:2]
    ev.play(played, ev.BotPolicy("greedy"))
    results = [ev.result(g) for g in played]
    ev.write_outputs(played, results, ev.summarize(results, played), str(tmp_path))
    for g in played:
        stem = tmp_path / "greedy" / g.name
        loaded = load_game(f"{stem}.json")
        assert loaded.get_current_phase() == g.game.get_current_phase() == "S1902M"
        assert dg.centre_counts(loaded) == dg.centre_counts(g.game)
        assert [p.name for p in loaded.get_phase_history()] == [p.name for p in g.game.get_phase_history()]
        assert orders_by_phase(loaded) == orders_by_phase(g.game) and orders_by_phase(loaded)
        svg = (tmp_path / "greedy" / f"{g.name}.svg").read_text()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "S1902M" in svg.upper()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["power"] for r in saved["games"]] == [g.power for g in played]
    assert saved["metrics"]["diplomacy/greedy/games"] == 2


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(corpus(num_games=2, last_year=1904))


def test_evaluate_with_the_hf_engine_batches_every_game_per_phase(tokenizer, tmp_path):
    from colocate.config import ModelConfig
    from colocate.engine.hf import HFEngine
    from colocate.models import build_model
    engine = HFEngine(build_model(ModelConfig(shape="tiny"), tokenizer), tokenizer, seed=0)
    calls = []
    generate = engine.generate
    engine.generate = lambda requests: calls.append(requests) or generate(requests)
    env = DiplomacyEnv(tokenizer, DiplomacySettings(group_size=2, max_new_tokens=160))
    cfg = EvalConfig(games=1, opponents=["random", "hold"], horizon_years=1, temperature=0.0)
    metrics = env.evaluate(engine, cfg, out_dir=str(tmp_path))
    for opponent in ("random", "hold"):
        p = f"diplomacy/{opponent}/"
        assert metrics[p + "games"] == 7 and metrics[p + "invalid_order_rate"] < 0.05
        for name in ("mean_centres", "mean_gain", "survival_rate", "win_rate"):
            assert metrics[p + name + "_lo"] <= metrics[p + name] <= metrics[p + name + "_hi"]
        assert len(os.listdir(tmp_path / opponent)) == 14  # a saved game and a board per game
    assert len(calls[0]) == 14  # the opening: every game's policy prompt in one call
    assert len(calls) <= 4  # one call per round: S, F, (retreats), W of one year
    assert all(r.temperature == 0.0 and r.constraint is not None for batch in calls for r in batch)
    assert env.metrics()["completions"] == 0  # evaluation leaves the training counters alone


def test_config_rejects_an_unknown_opponent():
    path = os.path.join(REPO, "configs", "cpu-diplomacy-tiny.yaml")
    assert load_config(path, {"eval": {"opponents": "greedy,hold"}}).eval.opponents == ["greedy", "hold"]
    with pytest.raises(ConfigError, match="eval.opponents"):
        load_config(path, {"eval": {"opponents": "greedy,dumbbot"}})


def test_a_board_shared_by_two_games_is_rendered_once(tmp_path, monkeypatch):
    played = ev.new_games(["hold"], 2, 1)[:2]  # AUSTRIA-0 and AUSTRIA-1: every power holds
    ev.play(played, ev.BotPolicy("hold"))
    rendered = []
    render = type(played[0].game).render
    monkeypatch.setattr(type(played[0].game), "render", lambda self, **kw: rendered.append(1) or render(self, **kw))
    ev.write_outputs(played, [ev.result(g) for g in played], {}, str(tmp_path))
    assert len(rendered) == 1
    assert (tmp_path / "hold" / "AUSTRIA-0.svg").read_text() == (tmp_path / "hold" / "AUSTRIA-1.svg").read_text()
