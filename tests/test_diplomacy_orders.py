"""Parsing: lenient on free text, never raises, everything dropped is counted (fuzz: 10,000)."""
import random
import string

from colocate.envs.diplomacy import game as dg
from colocate.envs.diplomacy.orders import normalize_line, parse_orders
from colocate.envs.diplomacy.prompt import BUILD, PowerOrders, completion_text, power_orders


def opening(power="FRANCE"):
    game = dg.new_game()
    return power_orders(game, dg.legal_orders(game))[power]


def test_lenient_free_text():
    orders = opening()
    text = "1. a par -> bur\n- F BRE - MAO.\n* Army Marseilles holds\nA MAR H\n"
    parsed = parse_orders(text, orders)
    assert parsed.orders == ["F BRE - MAO", "A MAR H", "A PAR - BUR"]
    assert parsed.num_invalid == 0 and parsed.num_garbled == 1  # "Army Marseilles holds" is not an order
    assert parse_orders("PAR - PIC; BRE H", orders).orders == ["F BRE H", "A PAR - PIC"]
    assert normalize_line("  f bre  move to  mao ") == "F BRE - MAO"


def test_without_unit_labels_the_line_position_names_the_unit():
    orders = opening()  # FRANCE: F BRE, A MAR, A PAR
    parsed = parse_orders("- MAO\nH\n- BUR\n", orders, unit_labels=False)
    assert parsed.orders == ["F BRE - MAO", "A MAR H", "A PAR - BUR"] and parsed.num_invalid == 0
    # a garbled line still takes its position; a line naming its unit is read as such
    parsed = parse_orders("- XYZ\nA PAR - PIC\n- GAS\n", orders, unit_labels=False)
    assert parsed.orders == ["A PAR - PIC"] and parsed.num_garbled == 2 and parsed.num_invalid == 2
    # more lines than units: the extra ones are garbled, never another unit's order
    parsed = parse_orders("H\nH\nH\nH\n", orders, unit_labels=False)
    assert parsed.orders == ["F BRE H", "A MAR H", "A PAR H"] and parsed.num_garbled == 1
    builds = PowerOrders("FRANCE", BUILD, ["build"] * 2, [["A MAR B", "A PAR B", "F MAR B", "WAIVE"]] * 2)
    assert parse_orders("A MAR B\nWAIVE\n", builds, unit_labels=False).orders == ["A MAR B", "WAIVE"]


def test_missing_coast_and_duplicates():
    game = dg.new_game()
    russia = power_orders(game, dg.legal_orders(game))["RUSSIA"]
    parsed = parse_orders("F STP - BOT\nF STP/SC H\nA MOS - UKR\nA MOS H\n", russia)
    assert "F STP/SC - BOT" in parsed.orders and "A MOS - UKR" in parsed.orders
    assert parsed.num_garbled == 2 and parsed.num_invalid == 2  # SEV and WAR have no order


def test_adjustment_limits_and_repeats():
    builds = PowerOrders("FRANCE", BUILD, ["build"] * 2, [["A MAR B", "A PAR B", "F MAR B", "WAIVE"]] * 2)
    parsed = parse_orders("A MAR B\nF MAR B\nA PAR B\n", builds)
    assert parsed.orders == ["A MAR B", "A PAR B"] and parsed.num_invalid == 0 and parsed.num_garbled == 1
    parsed = parse_orders("WAIVE\nWAIVE\nWAIVE\n", builds)
    assert parsed.orders == ["WAIVE", "WAIVE"] and parsed.num_garbled == 1
    assert parse_orders("", builds).num_invalid == 2


def garble(rng, text):
    ops = [lambda t: t.lower(), lambda t: t.replace(" ", ""),
           lambda t: t.replace("-", rng.choice(["->", "=>", "", "--"])),
           lambda t: t[: rng.randrange(len(t) + 1)], lambda t: t[::-1],
           lambda t: "".join(rng.choice([c, c * 2, "", rng.choice(string.printable)]) for c in t),
           lambda t: rng.choice(["1. ", "- ", "* ", "\u2022 ", ""]) + t,
           lambda t: t.replace("\n", rng.choice([";", ",", " "]))]
    for _ in range(rng.randrange(4)):
        text = rng.choice(ops)(text)
    return text


def test_fuzz_10000_completions_never_raise_and_are_accounted_for():
    rng = random.Random(0)
    cases, game = [], dg.new_game()
    while len(cases) < 40 and not game.is_game_done:  # varied phases, incl. retreats and adjustments
        legal = dg.legal_orders(game)
        cases.extend(power_orders(game, legal).values())
        for power, per_loc in legal.items():
            game.set_orders(power, [rng.choice(v) for v in per_loc.values()])
        game.process()
    alphabet = string.printable + "\u00e9\u2192\u2013\u4e2d\x00"
    for i in range(10_000):
        orders = rng.choice(cases)
        unit_labels = i % 2 == 0
        picks = [rng.choice(c) for c in orders.choices]
        legal_text = completion_text(picks, None if unit_labels or orders.kind not in ("M", "R") else orders.labels)
        kind = i % 3
        if kind == 0:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(200)))
        elif kind == 1:
            text = garble(rng, legal_text)
        else:
            text = "\n".join(rng.choice([legal_text, garble(rng, legal_text), "ORDERS:", "", "x" * 500])
                             for _ in range(rng.randrange(1, 5)))
        parsed = parse_orders(text, orders, unit_labels=unit_labels)
        allowed = set(o for c in orders.choices for o in c)
        assert all(o in allowed for o in parsed.orders)
        assert len(parsed.orders) + parsed.num_invalid == orders.num_slots
        if orders.kind in ("M", "R"):
            units = [" ".join(o.split()[:2]) for o in parsed.orders]
            assert len(units) == len(set(units))
