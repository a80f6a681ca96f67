"""Fork correctness, engine-format orders, legal orders and the state cache (CPU, ~10 s)."""
import json
import os
import random

import pytest

from colocate.envs.diplomacy import game as dg

CACHE = os.path.join(os.path.dirname(dg.__file__), "states.jsonl")


def snapshot(game):
    state = game.get_state()
    state.pop("timestamp")
    return (game.get_current_phase(), state, {p: sorted(game.get_orders(p)) for p in dg.POWERS},
            dict(game.dislodged), {p: dict(game.powers[p].retreats) for p in dg.POWERS},
            [str(k) for k in game.state_history.keys()], [str(k) for k in game.order_history.keys()])


def random_orders(game, rng, support_bias=0.0):
    out = {}
    for power, per_loc in dg.legal_orders(game).items():
        chosen = []
        for orders in per_loc.values():
            fancy = [o for o in orders if " S " in o or " C " in o or "VIA" in o]
            chosen.append(rng.choice(fancy) if fancy and rng.random() < support_bias else rng.choice(orders))
        out[power] = chosen
    return out


def play(game, orders, expand=True):
    for power, chosen in orders.items():
        game.set_orders(power, chosen, expand=expand)
    game.process()


def random_game(rng, year):
    game = dg.new_game()
    while not game.is_game_done and dg.phase_key(game.get_current_phase())[0] < year:
        play(game, random_orders(game, rng))
    return game


def replay(orders_per_phase):
    game = dg.new_game()
    for orders in orders_per_phase:
        play(game, orders)
    return game


def test_fork_clones_are_independent_and_correct():
    """Clones processed with different orders, interleaved, equal a replay from the opening of the
    same orders, and neither the source nor a sibling changes; covers M, R and A fork phases."""
    rng = random.Random(0)
    checked, phase_types = 0, set()
    for _ in range(6):
        game, past = dg.new_game(), []
        for _ in range(rng.randint(0, 24)):
            past.append(random_orders(game, rng))
            play(game, past[-1])
        for _ in range(4):  # fork at consecutive phases
            if game.is_game_done:
                break
            phase_types.add(game.phase_type)
            before = snapshot(game)
            clones = [dg.fork_game(game) for _ in range(4)]
            assert [snapshot(c) for c in clones] == [before] * 4
            futures = [[] for _ in clones]
            for _ in range(3):
                for clone, future in zip(clones, futures):  # round robin: any sharing would leak
                    if not clone.is_game_done:
                        future.append(random_orders(clone, rng, support_bias=0.3))
                        play(clone, future[-1])
            for clone, future in zip(clones, futures):
                assert snapshot(clone) == snapshot(replay(past + future))
                checked += 1
            assert snapshot(game) == before
            past.append(random_orders(game, rng))
            play(game, past[-1])
    assert checked >= 80 and {"M", "R", "A"} <= phase_types


def test_fork_keeps_history_and_source_keeps_its_own():
    rng = random.Random(1)
    game = random_game(rng, 1904)
    num_phases = len(game.state_history)
    clone = dg.fork_game(game)
    assert list(map(str, clone.state_history.keys())) == list(map(str, game.state_history.keys()))
    play(clone, random_orders(clone, rng))
    assert len(clone.state_history) == num_phases + 1 and len(game.state_history) == num_phases
    assert clone.map is game.map  # shared, never copied


def test_engine_order_matches_set_orders_expand():
    """Our expand=False path stores the same orders and reaches the same states as expand=True."""
    rng = random.Random(2)
    memo, phases, coast_supports = {}, 0, 0
    for _ in range(12):
        game = dg.new_game()
        while not game.is_game_done and dg.phase_key(game.get_current_phase())[0] < 1911:
            orders = random_orders(game, rng, support_bias=0.6)
            coast_supports += sum(1 for os_ in orders.values() for o in os_ if " S " in o and "/" in o.split()[-1])
            a, b = dg.fork_game(game), dg.fork_game(game)
            for power, chosen in orders.items():
                a.set_orders(power, chosen)
                b.set_orders(power, [dg.engine_order(o, b.map, memo) for o in chosen], expand=False)
            assert {p: sorted(a.get_orders(p)) for p in dg.POWERS} == {p: sorted(b.get_orders(p)) for p in dg.POWERS}
            a.process()
            b.process()
            assert snapshot(a) == snapshot(b)
            game, phases = a, phases + 1
    assert phases > 300 and coast_supports > 0


def test_legal_orders_once_per_phase_equals_per_power_and_is_sorted():
    rng = random.Random(3)
    for year in (1901, 1903, 1906):
        game = random_game(rng, year)
        for _ in range(3):
            legal = dg.legal_orders(game)
            for power in dg.POWERS:
                expected = dg.legal_orders_baseline(game, power)
                assert legal.get(power, {}) == expected
                for orders in expected.values():
                    assert orders == sorted(orders)
            assert all(game.get_orderable_locations(p) for p in legal)
            play(game, random_orders(game, rng))


def test_committed_state_cache_loads():
    states = dg.load_state_cache(CACHE)
    assert len(states) >= 50
    assert all(s["name"].endswith("M") for s in states)
    game = dg.game_from_state(states[0])
    assert game.get_current_phase() == states[0]["name"] and not game.error
    assert os.path.getsize(CACHE) < 500 * 1024


def test_state_round_trip_restores_the_board():
    rng = random.Random(4)
    game = random_game(rng, 1905)
    while not game.get_current_phase().endswith("M"):
        play(game, random_orders(game, rng))
    restored = dg.game_from_state(game.get_state())
    orders = random_orders(game, rng)
    play(game, orders)
    play(restored, orders)
    assert snapshot(game)[1:3] == snapshot(restored)[1:3]


@pytest.mark.parametrize("content,needle", [
    ("{not json\n", "not valid JSON"),
    ("[1, 2]\n", "expected a JSON object"),
    ('{"name": "S1905M"}\n', "missing keys"),
    ("", "contains no states"),
])
def test_corrupt_state_cache_is_refused_naming_the_file(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(dg.StateCacheError) as info:
        dg.load_state_cache(str(path))
    assert str(path) in str(info.value) and needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_state_cache_with_bad_fields_or_retreat_phase_is_refused(tmp_path):
    good = json.loads(open(CACHE).readline())
    cases = {"name": "X1905Q", "units": {"FRANCE": ["A PAR"]}, "centers": {p: "PAR" for p in dg.POWERS}}
    for key, value in cases.items():
        path = tmp_path / f"bad-{key}.jsonl"
        path.write_text(json.dumps(dict(good, **{key: value})) + "\n")
        with pytest.raises(dg.StateCacheError, match="line 1"):
            dg.load_state_cache(str(path))
    path = tmp_path / "retreat.jsonl"
    path.write_text(json.dumps(dict(good, name="F1905R")) + "\n")
    with pytest.raises(dg.StateCacheError, match="retreat"):
        dg.load_state_cache(str(path))
    path = tmp_path / "truncated.jsonl"
    path.write_text(open(CACHE).read()[:3000])
    with pytest.raises(dg.StateCacheError, match=str(path)):
        dg.load_state_cache(str(path))
    with pytest.raises(dg.StateCacheError, match="no such file"):
        dg.load_state_cache(str(tmp_path / "missing.jsonl"))
