"""Compact prompts and the legal-order constraint, per (game phase, power).

A prompt is three parts, so that prefix caching shares the first two across the 7 powers of a game:

    Diplomacy. You command one power; ...        INSTRUCTION: identical for every prompt
    PHASE S1901M                                 the board: identical for the 7 powers of a phase
    AUSTRIA: A BUD A VIE F TRI; centres BUD TRI VIE
    ...
    NEUTRAL: centres BEL BUL DEN ...
    YOU: FRANCE                                  the power's own part: one line per slot
    F BRE: - ENG GAS MAO PIC; H; S A MAR GAS; S A PAR GAS PIC; S F LON ENG
    A MAR: ...
    ORDERS:

Own-part lines group a unit's legal orders (`compact_options`: '- X Y' moves, 'S A MAR H GAS'
support to hold or to move, 'C A LON BEL' convoys, 'VIA X', 'R X'), about 40 % fewer tokens than
listing every order. The completion writes each order in full, one per line, in the listed unit
order: "F BRE - MAO\nA MAR - SPA\nA PAR - BUR\n" then EOS.

With `unit_labels=False` a line leaves its unit out ("- MAO\n- SPA\n- BUR\n"): the line's position
names the unit, as the own part lists them. Under the constraint those unit tokens are forced (the
slot allows only that unit's orders), so writing them costs a decode step each and decides nothing:
about 2.3 of 7.1 tokens a unit with the embedded tokenizer, a third of every phase's decode steps.
Adjustment lines ('A PAR B', 'WAIVE') are always written in full.

Constraint: one slot per line of the own part; each choice is the token ids of one legal order's
line (in full, or without the unit: `order_line`) plus "\n", tokenized alone (`Constraint.texts`
keeps the strings for grammar engines). Byte-level BPE decodes a concatenation of id sequences to
the concatenation of their texts, so the decoded completion is exactly the lines `orders.py` parses.

Adjustment phases: a power with builds gets `count` slots (count = min(free home centres, centres -
units), as the engine counts), each offering every build order of every free home centre plus
WAIVE; a power with too many units gets `count = units - centres` slots, each offering every
disband order. A slot cannot see the others, so two slots may pick the same site: the parser keeps
the first and counts the repeat as invalid (the engine then builds fewer, or disbands by its
civil-disorder rule). Retreats: one slot per dislodged unit (R X or D).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cached_property

from colocate.constraint import Constraint
from colocate.envs.diplomacy.game import NUM_CENTRES, POWERS

INSTRUCTION = (
    "Diplomacy. You command one power; the board gives each power's units and supply centres. "
    "Write one legal order per unit listed under YOU, in that order, each in full on its own line "
    "(e.g. A PAR - BUR). Options: H hold; - X Y: move to X or Y; VIA X: move to X by convoy; "
    "S A MUN H X: support A MUN to hold or to move to X; C A LON X: convoy A LON to X; R X: retreat "
    "to X; D disband. Winter: one line per build (A PAR B, or WAIVE) or disband.\n")
INSTRUCTION_NO_UNITS = (
    "Diplomacy. You command one power; the board gives each power's units and supply centres. "
    "Write one legal order per unit listed under YOU, in that order, each on its own line without "
    "the unit (for A PAR - BUR write - BUR). Options: H hold; - X Y: move to X or Y; VIA X: move to X "
    "by convoy; S A MUN H X: support A MUN to hold or to move to X; C A LON X: convoy A LON to X; "
    "R X: retreat to X; D disband. Winter: one line per build (A PAR B, or WAIVE) or disband.\n")


UNLISTED_SUPPORTS = ("Supports and convoys are not listed under YOU: write any legal one as "
                     "A PAR S A MUN, A PAR S A MUN - BUR or F NTH C A LON - BEL.\n")
UNLISTED_SUPPORTS_NO_UNITS = ("Supports and convoys are not listed under YOU: write any legal one as "
                              "S A MUN, S A MUN - BUR or C A LON - BEL.\n")


def instruction(unit_labels: bool = True, list_supports: bool = True) -> str:
    """The static instruction for the completion format (see the module docstring); without the
    support lists it adds how to write the unlisted orders, in the completion format."""
    extra = "" if list_supports else UNLISTED_SUPPORTS if unit_labels else UNLISTED_SUPPORTS_NO_UNITS
    return (INSTRUCTION if unit_labels else INSTRUCTION_NO_UNITS) + extra


MOVE, RETREAT, BUILD, DISBAND = "M", "R", "B", "D"
_COAST = re.compile(r"/[NESW]C")
_PIECES = re.compile(r" ?[^ ]+| +")  # split before each space (see TokenCache)


@dataclass
class PowerOrders:
    """What one power must order in one phase: slots in prompt order, each with its legal orders."""
    power: str
    kind: str
    """M movement, R retreat (one slot per unit), B build, D disband (one slot per opportunity)."""
    labels: list[str]
    """Per slot: the unit ('A PAR', 'F STP/SC'), or 'build'/'disband' for adjustment slots."""
    choices: list[list[str]]
    """Per slot: sorted legal orders in the engine's format ('A PAR - BUR', 'WAIVE')."""

    @property
    def num_slots(self) -> int:
        return len(self.choices)

    @cached_property
    def slot_of(self) -> dict[str, int]:
        """Legal order -> its slot (movement/retreat); every order -> 0 for adjustment slots."""
        return {o: i for i, choices in enumerate(self.choices) for o in choices}

    @cached_property
    def without_coasts(self) -> dict[str, str]:
        """Order with coasts removed ('F STP - BOT') -> legal order, where that is unambiguous."""
        index: dict[str, str | None] = {}
        for order in self.slot_of:
            key = _COAST.sub("", order)
            index[key] = None if key in index else order
        return {k: v for k, v in index.items() if v is not None}


def power_orders(game, legal: dict[str, dict[str, list[str]]]) -> dict[str, PowerOrders]:
    """Slots per power for the current phase, from `game.legal_orders(game)` (already sorted)."""
    phase_type = game.phase_type
    out = {}
    for power_name, per_loc in legal.items():
        if phase_type == "A":
            power = game.powers[power_name]
            surplus = len(power.centers) - len(power.units)
            union = sorted({o for orders in per_loc.values() for o in orders})
            if surplus > 0:
                count = min(len(per_loc), surplus)  # as Game.get_state()['builds']
                kind, label = BUILD, "build"
            else:
                count = -surplus
                kind, label = DISBAND, "disband"
            if count <= 0:
                continue
            out[power_name] = PowerOrders(power_name, kind, [label] * count, [union] * count)
        else:
            labels, choices = [], []
            for orders in per_loc.values():
                labels.append(" ".join(orders[0].split()[:2]))
                choices.append(orders)
            out[power_name] = PowerOrders(power_name, RETREAT if phase_type == "R" else MOVE, labels, choices)
    return out


def board_lines(game) -> list[str]:
    """The shared board: phase, then per power its units, dislodged units and centres, then neutrals."""
    lines = [f"PHASE {game.get_current_phase()}\n"]
    owned = set()
    for name in POWERS:
        power = game.powers[name]
        owned.update(power.centers)
        if not power.units and not power.centers and not power.retreats:
            lines.append(f"{name}: eliminated\n")
            continue
        text = f"{name}: {' '.join(sorted(power.units)) or 'no units'}"
        if power.retreats:
            text += f"; dislodged {' '.join(sorted(power.retreats))}"
        text += f"; centres {' '.join(sorted(power.centers)) or 'none'}\n"
        lines.append(text)
    neutral = sorted(c for c in game.map.scs if c not in owned)
    if neutral and len(owned) < NUM_CENTRES:
        lines.append(f"NEUTRAL: centres {' '.join(neutral)}\n")
    return lines


def compact_options(label: str, orders: list[str], list_supports: bool = True) -> str:
    """A unit's legal orders grouped by kind: '- BUR GAS; S A MAR H BUR; H' ('A PAR' omitted).

    `expand_options` inverts it; orders of no known shape are kept verbatim (none seen so far).
    `list_supports=False` leaves out the support and convoy groups (see `own_lines`)."""
    groups: dict[str, list[str]] = {}
    for order in orders:
        words = order[len(label) + 1:].split()
        if not list_supports and len(words) >= 3 and words[0] in ("S", "C"):
            continue
        if len(words) == 2 and words[0] == "-":
            groups.setdefault("-", []).append(words[1])
        elif len(words) == 3 and words[0] == "-" and words[2] == "VIA":
            groups.setdefault("VIA", []).append(words[1])
        elif len(words) == 3 and words[0] == "S":
            groups.setdefault(f"S {words[1]} {words[2]}", []).append("H")
        elif len(words) == 5 and words[0] in ("S", "C") and words[3] == "-":
            groups.setdefault(" ".join(words[:3]), []).append(words[4])
        elif len(words) == 2 and words[0] == "R":
            groups.setdefault("R", []).append(words[1])
        else:
            groups.setdefault(" ".join(words), [])
    return "; ".join(f"{head} {' '.join(tails)}".rstrip() for head, tails in groups.items())


def expand_options(label: str, text: str) -> list[str]:
    """Full orders from `compact_options` text (tests check the round trip)."""
    out = []
    for part in text.split("; "):
        words = part.split()
        head = words[0]
        if head in ("-", "R"):
            out += [f"{label} {head} {x}" for x in words[1:]]
        elif head == "VIA":
            out += [f"{label} - {x} VIA" for x in words[1:]]
        elif head in ("S", "C") and len(words) >= 4:
            unit = " ".join(words[1:3])
            out += [f"{label} {head} {unit}" if x == "H" else f"{label} {head} {unit} - {x}" for x in words[3:]]
        else:
            out.append(f"{label} {part}")
    return out


def own_lines(orders: PowerOrders, list_supports: bool = True) -> list[str]:
    """The power's own part: header, one line per slot (options grouped, see compact_options), footer.

    `list_supports=False` lists moves, holds, convoyed moves and retreats only. Supports and
    convoys are 70 % of the own part's tokens mid-game, and the own part is nearly all of what the
    engine must prefill per request (the instruction and board are shared by prefix caching), so
    this cuts prefill per request by about two thirds (`profiles/env.md`). The constraint still
    allows every legal order, so the policy can write any support; it just does not see them listed.
    """
    lines = [f"YOU: {orders.power}\n"]
    if orders.kind in (MOVE, RETREAT):
        for label, choices in zip(orders.labels, orders.choices):
            lines.append(f"{label}: {compact_options(label, choices, list_supports)}\n")
    else:
        word = "BUILD" if orders.kind == BUILD else "DISBAND"
        lines.append(f"{word} {orders.num_slots}: {'; '.join(orders.choices[0])}\n")
    lines.append("ORDERS:\n")
    return lines


def order_line(order: str, label: str, unit_labels: bool = True) -> str:
    """The completion line of `order` in the slot labelled `label`: in full, or without the unit."""
    if unit_labels or not order.startswith(label + " "):
        return f"{order}\n"
    return f"{order[len(label) + 1:]}\n"


def completion_text(orders: list[str], labels: list[str] | None = None) -> str:
    """The completion text for full orders, one per slot (what the constraint's choices concatenate
    to); with the slots' `labels`, in the `unit_labels=False` format."""
    if labels is None:
        return "".join(f"{o}\n" for o in orders)
    return "".join(order_line(o, label, unit_labels=False) for o, label in zip(orders, labels))


class TokenCache:
    """Token ids of prompts and order choices for one tokenizer, memoized.

    Byte-level BPE never merges across pre-tokens, and with GPT-2/Qwen-style pre-tokenizers a
    space before a word always starts one; so a text split before each space can be encoded piece
    by piece from a small memo of pieces (' BUR', ' -', ' |', ...), ~10x faster than the Rust
    tokenizer on the mostly-new lines of a mid-game phase. Whether that holds for the tokenizer at
    hand is checked on sample prompts at construction; if not, texts are encoded whole."""

    def __init__(self, tokenizer, sample_texts: list[str] = (), max_entries: int = 200_000,
                 instruction_text: str = INSTRUCTION):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._pieces: dict[str, list[int]] = {}
        self._choices: dict[str, list[int]] = {}
        self.is_piecewise = True
        samples = [instruction_text, *sample_texts]
        self.is_piecewise = all(self.encode(t) == self._encode_whole(t) for t in samples)
        if not self.is_piecewise:
            self._pieces.clear()
        self.instruction_ids = self.encode(instruction_text)

    def _encode_whole(self, text: str) -> list[int]:
        if self._backend is not None:  # the Rust tokenizer directly: far less overhead per call
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        if not self.is_piecewise:
            return self._encode_whole(text)
        if len(self._pieces) > self.max_entries:
            self._pieces.clear()  # bounded memory; entries are recomputed on demand
        ids: list[int] = []
        memo = self._pieces
        for piece in _PIECES.findall(text):
            seq = memo.get(piece)
            if seq is None:
                seq = memo[piece] = self._encode_whole(piece)
            ids.extend(seq)
        return ids

    def choice_ids(self, text: str) -> list[int]:
        seq = self._choices.get(text)
        if seq is None:
            if len(self._choices) > self.max_entries:
                self._choices.clear()
            seq = self._choices[text] = self.encode(text)
        return seq

    def prompt_ids(self, board_ids: list[int], own: list[str]) -> list[int]:
        return self.instruction_ids + board_ids + self.encode("".join(own))

    def constraint(self, orders: PowerOrders, eos_id: int, unit_labels: bool = True) -> Constraint:
        texts = [[order_line(o, label, unit_labels) for o in choices]
                 for label, choices in zip(orders.labels, orders.choices)]
        slots = [[self.choice_ids(t) for t in lines] for lines in texts]
        return Constraint(slots=slots, eos_id=eos_id, texts=texts)


def opening_texts(unit_labels: bool = True, list_supports: bool = True) -> list[str]:
    """Board, own parts and first orders of the opening, in the given completion format: samples
    to check a tokenizer against."""
    from colocate.envs.diplomacy.game import legal_orders, new_game
    game = new_game()
    board = "".join(board_lines(game))
    texts = [board]
    for orders in power_orders(game, legal_orders(game)).values():
        own = "".join(own_lines(orders, list_supports))
        chosen = [c[-1] for c in orders.choices]
        texts += [own, instruction(unit_labels, list_supports) + board + own,
                  completion_text(chosen, None if unit_labels else orders.labels)]
    return texts


def max_completion_tokens(constraint: Constraint) -> int:
    """Longest completion the constraint allows, EOS included."""
    return sum(max(len(c) for c in slot) for slot in constraint.slots) + 1


CORPUS_VERSION = "2"
"""Keys the cached embedded tokenizer: bump it whenever the prompt or order format changes."""


def corpus(num_games: int = 8, last_year: int = 1910, seed: int = 0) -> list[str]:
    """Prompts and completions of seeded random games: every power's prompt in every phase."""
    from colocate.envs.diplomacy import game as dg
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
