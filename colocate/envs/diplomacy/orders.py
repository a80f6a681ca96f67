"""Completion text -> legal orders, leniently and without ever raising.

Under the constraint a completion is exactly one line per slot, the order in full or, with
`unit_labels=False`, without its unit (the slot's unit is then put in front of the k-th non-empty
line before matching); without the constraint the text is free, so each line (also split at ';'
and ',') is normalized (case, bullets, arrows, words such as HOLD or SUPPORTS) and matched against
the power's legal orders: exactly, then without coasts, then with the unit type added. Every accepted order is legal; everything else is counted:
  * invalid slots: units (or build/disband opportunities) left without a legal order; the engine
    holds those units (or builds nothing / disbands by its civil-disorder rule);
  * garbled lines: non-empty lines that were not accepted (unparsable, illegal, a second order for
    the same unit, or more builds/disbands than allowed).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from colocate.envs.diplomacy.prompt import BUILD, DISBAND, PowerOrders

MAX_CHARS = 4096   # bound the work on adversarial completions
MAX_LINES = 128
MAX_LINE_CHARS = 64

_SPLIT = re.compile(r"[\n;,]")
_BULLET = re.compile(r"^(?:[*#>\u2022]+|\d+[.)]|-(?=\s*[AF]\s))\s*")
_DASHES = re.compile(r"\s*(?:->|=>|\u2192|\u2013|\u2014|-)\s*")
_COAST = re.compile(r"/[NESW]C")
_WORDS = {"HOLD": "H", "HOLDS": "H", "SUPPORT": "S", "SUPPORTS": "S", "CONVOY": "C", "CONVOYS": "C",
          "RETREAT": "R", "RETREATS": "R", "DISBAND": "D", "DISBANDS": "D", "BUILD": "B", "BUILDS": "B",
          "ARMY": "A", "FLEET": "F", "MOVE": "-", "MOVES": "-", "TO": "-"}


@dataclass
class ParsedOrders:
    orders: list[str]
    """Legal orders, at most one per slot, in the engine's format."""
    num_invalid: int
    """Slots left without a legal order."""
    num_garbled: int
    """Non-empty lines that were not accepted."""


def normalize_line(raw: str) -> str:
    """Canonical spelling of one order line ('' for blank or hopeless lines)."""
    line = raw.strip().upper()
    if not line or len(line) > MAX_LINE_CHARS:
        return line[:MAX_LINE_CHARS] if line else ""
    line = _BULLET.sub("", line)
    line = _DASHES.sub(" - ", line).strip(" .:!\t\r")
    words: list[str] = []
    for word in line.split():
        word = _WORDS.get(word, word)
        if word == "-" and words and words[-1] == "-":
            continue
        words.append(word)
    return " ".join(words)


def match_order(line: str, orders: PowerOrders) -> str | None:
    """The legal order `line` means, or None."""
    slot_of = orders.slot_of
    if line in slot_of:
        return line
    loose = orders.without_coasts
    for candidate in (line, "A " + line, "F " + line):
        if candidate in slot_of:
            return candidate
        found = loose.get(_COAST.sub("", candidate))
        if found is not None:
            return found
    return None


def parse_orders(text: str, orders: PowerOrders, unit_labels: bool = True) -> ParsedOrders:
    """Completion text -> at most one legal order per slot, plus counts of what was dropped.

    With `unit_labels=False` (movement and retreat phases) the k-th non-empty line is read as the
    order of slot k without its unit ("- BUR" in the slot of A PAR); a line that names its unit
    anyway is still accepted. Positions make free text fragile: one stray line ("ORDERS:", a
    preamble) shifts every later bare line onto the wrong unit, and those count as garbled. Under
    the constraint that cannot happen."""
    adjustment = orders.kind in (BUILD, DISBAND)
    positional = not unit_labels and not adjustment
    by_slot: dict[int, str] = {}
    accepted: list[str] = []
    used_sites: set[str] = set()
    garbled = 0
    position = 0
    for raw in _SPLIT.split(text[:MAX_CHARS])[:MAX_LINES]:
        line = normalize_line(raw)
        if not line:
            continue
        order = None
        if positional and position < orders.num_slots:  # the slot's unit in front: only its orders match
            order = match_order(f"{orders.labels[position]} {line}", orders)
        position += 1
        if order is None:
            order = match_order(line, orders)
        if order is None:
            garbled += 1
            continue
        if adjustment:
            site = order.split()[1][:3] if order != "WAIVE" else None
            if len(accepted) >= orders.num_slots or (site is not None and site in used_sites):
                garbled += 1
                continue
            accepted.append(order)
            if site is not None:
                used_sites.add(site)
        else:
            slot = orders.slot_of[order]
            if slot in by_slot:
                garbled += 1
                continue
            by_slot[slot] = order
    if not adjustment:
        accepted = [by_slot[s] for s in sorted(by_slot)]
    return ParsedOrders(orders=accepted, num_invalid=orders.num_slots - len(accepted), num_garbled=garbled)
