"""Prompt layout, prefix sharing, tokenization and the legal-order constraint (CPU, a few seconds)."""
import random

import pytest

from colocate.constraint import ConstraintState
from colocate.envs.diplomacy import corpus
from colocate.envs.diplomacy import game as dg
from colocate.envs.diplomacy.orders import parse_orders
from colocate.envs.diplomacy.prompt import (BUILD, DISBAND, INSTRUCTION, TokenCache, board_lines, compact_options,
                                            completion_text, expand_options, instruction, max_completion_tokens,
                                            opening_texts, own_lines, power_orders)
from colocate.models import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(corpus(num_games=2, last_year=1904))


def phases(num_games=6, last_year=1909, seed=0):
    """(game, legal) at every phase of a few seeded random games."""
    rng = random.Random(seed)
    for _ in range(num_games):
        game = dg.new_game()
        while not game.is_game_done and dg.phase_key(game.get_current_phase())[0] <= last_year:
            legal = dg.legal_orders(game)
            yield game, legal
            for power, per_loc in legal.items():
                game.set_orders(power, [rng.choice(v) for v in per_loc.values()])
            game.process()


def test_prompts_share_instruction_and_board_and_tokenize_canonically(tokenizer):
    cache = TokenCache(tokenizer, opening_texts())
    assert cache.is_piecewise
    for game, legal in list(phases(num_games=2, last_year=1905))[::3]:
        board = "".join(board_lines(game))
        board_ids = cache.encode(board)
        prefix = cache.instruction_ids + board_ids
        for power, orders in power_orders(game, legal).items():
            own = own_lines(orders)
            ids = cache.prompt_ids(board_ids, own)
            assert ids[:len(prefix)] == prefix
            text = INSTRUCTION + board + "".join(own)
            assert ids == tokenizer.encode(text, add_special_tokens=False)  # piecewise == whole text
            assert tokenizer.decode(ids) == text
            assert own[0] == f"YOU: {power}\n" and own[-1] == "ORDERS:\n"


def test_own_part_lists_units_in_slot_order_with_their_orders():
    game = dg.new_game()
    orders = power_orders(game, dg.legal_orders(game))["FRANCE"]
    assert orders.labels == ["F BRE", "A MAR", "A PAR"]
    lines = own_lines(orders)
    assert lines[1] == "F BRE: - ENG GAS MAO PIC; H; S A MAR GAS; S A PAR GAS PIC; S F LON ENG\n"
    assert lines[3] == "A PAR: - BRE BUR GAS PIC; H; S A MAR BUR GAS; S A MUN BUR; S F BRE H GAS PIC\n"
    assert "NEUTRAL: centres BEL BUL" in "".join(board_lines(game))


def test_own_part_without_supports_lists_moves_and_holds_only():
    game = dg.new_game()
    orders = power_orders(game, dg.legal_orders(game))["FRANCE"]
    lines = own_lines(orders, list_supports=False)
    assert lines[1] == "F BRE: - ENG GAS MAO PIC; H\n"
    assert lines[3] == "A PAR: - BRE BUR GAS PIC; H\n"
    assert "Supports and convoys are not listed" in instruction(False, list_supports=False)
    assert "not listed" not in instruction(False)


def test_compact_options_round_trip():
    count = 0
    for game, legal in phases(num_games=4):
        for orders in power_orders(game, legal).values():
            if orders.kind in ("M", "R"):
                for label, choices in zip(orders.labels, orders.choices):
                    assert sorted(expand_options(label, compact_options(label, choices))) == choices
                    count += 1
    assert count > 1000


def test_fallback_when_piecewise_tokenization_would_differ(tokenizer):
    class Whole:  # a tokenizer whose ids depend on the whole text: piecewise must be refused
        backend_tokenizer = None
        def encode(self, text, add_special_tokens=False):
            return [len(text)]
    cache = TokenCache(Whole(), opening_texts())
    assert not cache.is_piecewise and cache.encode("A PAR - BUR\n") == [12]


@pytest.mark.parametrize("unit_labels", [True, False])
def test_constraint_completions_decode_to_the_orders_they_encode(tokenizer, unit_labels):
    cache = TokenCache(tokenizer, opening_texts(unit_labels), instruction_text=instruction(unit_labels))
    assert cache.is_piecewise
    rng = random.Random(1)
    kinds = set()
    for game, legal in phases():
        for power, orders in power_orders(game, legal).items():
            kinds.add(orders.kind)
            constraint = cache.constraint(orders, tokenizer.eos_token_id, unit_labels)
            assert len(constraint.slots) == orders.num_slots
            picks = [rng.randrange(len(slot)) for slot in constraint.slots]
            ids = [t for slot, k in zip(constraint.slots, picks) for t in slot[k]] + [tokenizer.eos_token_id]
            assert len(ids) <= max_completion_tokens(constraint)
            state = ConstraintState(constraint)  # the engine would accept this completion
            for t in ids:
                assert t in state.allowed()
                state.advance(t)
            assert state.done
            chosen = [orders.choices[i][k] for i, k in enumerate(picks)]
            text = tokenizer.decode(ids[:-1])
            movement = orders.kind not in (BUILD, DISBAND)
            assert text == completion_text(chosen, None if unit_labels or not movement else orders.labels)
            if not unit_labels and movement:  # no line names its unit: the position does
                assert all(not line.startswith(label) for line, label in zip(text.splitlines(), orders.labels))
            parsed = parse_orders(text, orders, unit_labels)
            if orders.kind in (BUILD, DISBAND):  # a repeated site is the one way to be invalid here
                sites = [o.split()[1][:3] for o in chosen if o != "WAIVE"]
                assert parsed.num_invalid == len(sites) - len(set(sites))
            else:
                assert parsed.orders == chosen and parsed.num_invalid == 0
    assert {"M", "R", BUILD, DISBAND} <= kinds


def test_adjustment_slots_follow_the_counts():
    for game, legal in phases(num_games=4):
        if game.phase_type != "A":
            continue
        for power, orders in power_orders(game, legal).items():
            p = game.powers[power]
            surplus = len(p.centers) - len(p.units)
            if orders.kind == BUILD:
                assert orders.num_slots == min(surplus, len(game._build_sites(p)))
                assert all("WAIVE" in c for c in orders.choices)
            else:
                assert orders.kind == DISBAND and orders.num_slots == -surplus
                assert all(o.endswith(" D") for o in orders.choices[0])


def test_without_unit_labels_a_third_fewer_completion_tokens(tokenizer):
    """The unit tokens are forced by the slot; leaving them out shortens every completion."""
    rng = random.Random(2)
    full, short = TokenCache(tokenizer, opening_texts()), TokenCache(tokenizer, opening_texts(),
                                                                      instruction_text=instruction(False))
    n_full = n_short = 0
    for game, legal in list(phases(num_games=2))[::2]:
        for orders in power_orders(game, legal).values():
            a = full.constraint(orders, tokenizer.eos_token_id)
            b = short.constraint(orders, tokenizer.eos_token_id, unit_labels=False)
            picks = [rng.randrange(len(slot)) for slot in a.slots]
            n_full += sum(len(slot[k]) for slot, k in zip(a.slots, picks))
            n_short += sum(len(slot[k]) for slot, k in zip(b.slots, picks))
    assert n_short < 0.8 * n_full
