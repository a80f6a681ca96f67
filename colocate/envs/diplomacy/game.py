"""Game-state mechanics on top of the `diplomacy` package: fork, legal orders, state cache, SC counts.

What the package gets wrong for RL, and what this module does instead (measured: the env profile,
`scripts/benchmark.py --profile env`, figures in `profiles/`):
  * `copy.deepcopy(game)` is slow (~0.4 s mid-game: history entries drag the map along) and wrong
    without `clear_cache()` (the unit-owner cache points at the source's powers). `fork_game` copies
    only the per-phase state, shares the immutable map, rules and written history entries, and
    resets the unit-owner cache: 0.35 ms for 8 clones at S1910M (deepcopy: 3.4 s).
  * `get_all_possible_orders()` is ~1 ms and never cached by the engine: `legal_orders` calls it
    once per phase and game, for all powers, and sorts every list (its order follows the hash seed).
  * A state cache line is exactly `Game.get_state()` (the package's own state format, JSON); it is
    loaded with `Game()` + `set_state`, which restores the board but not history (not needed here).

Deliberately absent: messages/press and rendering (saved games and pictures: `archive.py`).
"""
from __future__ import annotations

import json
import logging
import os
import re
import warnings

with warnings.catch_warnings():  # import-time ResourceWarning/DeprecationWarning of the package
    warnings.simplefilter("ignore")
    from diplomacy import Game
    from diplomacy.engine.power import Power
    from diplomacy.utils.sorted_dict import SortedDict
    from diplomacy.utils.sorted_set import SortedSet

logging.getLogger("diplomacy").setLevel(logging.WARNING)  # the package sets DEBUG on import

POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")
NUM_CENTRES = 34

# Slots shared between a game and its forks: immutable for the rest of the game, or caches that
# the engine only ever replaces (never mutates) once built.
_SHARED_GAME_SLOTS = frozenset({
    "map", "renderer", "victory", "no_rules", "meta_rules", "rules", "_phase_wrapper_type",
    "convoy_paths_possible", "convoy_paths_dest", "controlled_powers", "fixed_state"})
_SHARED_POWER_SLOTS = frozenset({"controller", "tokens"})


def _game_slots() -> tuple[str, ...]:
    return tuple(name for cls in Game.__mro__ for name in getattr(cls, "__slots__", ()))


_GAME_SLOTS = _game_slots()
_POWER_SLOTS = tuple(Power.__slots__)


def _copy_value(value):
    # One level deep is enough: the engine replaces nested values (retreat lists, order strings)
    # rather than mutating them, and rebuilds per-phase dicts (combat, supports) from scratch.
    kind = type(value)
    if kind is list:
        return list(value)
    if kind is dict:
        return dict(value)
    if kind is set:
        return set(value)
    if kind is SortedDict:
        return _copy_sorted_dict(value)
    return value


def _copy_sorted_dict(value: SortedDict) -> SortedDict:
    # SortedDict.copy() re-inserts every key through the map's phase comparator (~0.4 ms per
    # history at S1910M); copying its two containers is O(n) memcpy. Relies on the private layout
    # of diplomacy==1.1.2 (pinned); tests/test_diplomacy_game.py checks histories stay identical.
    keys = SortedSet.__new__(SortedSet)
    keys._SortedSet__type = value._SortedDict__keys._SortedSet__type
    keys._SortedSet__list = list(value._SortedDict__keys._SortedSet__list)
    out = SortedDict.__new__(SortedDict)
    out._SortedDict__val_type = value._SortedDict__val_type
    out._SortedDict__keys = keys
    out._SortedDict__couples = dict(value._SortedDict__couples)
    return out


def fork_game(game: Game) -> Game:
    """An independent copy of `game`: processing either never affects the other.

    Shares the map and the already-written history entries; copies the per-phase state (powers,
    orders, dislodged units, ...) and the history containers (so each side appends its own)."""
    clone = Game.__new__(Game)
    for name in _GAME_SLOTS:
        if not hasattr(game, name):
            continue
        value = getattr(game, name)
        setattr(clone, name, value if name in _SHARED_GAME_SLOTS else _copy_value(value))
    clone._unit_owner_cache = None  # maps units to the *source's* Power objects: rebuild lazily
    clone.powers = {}
    for power_name, power in game.powers.items():
        copy = Power.__new__(Power)
        for name in _POWER_SLOTS:
            value = getattr(power, name)
            setattr(copy, name, value if name in _SHARED_POWER_SLOTS else _copy_value(value))
        copy.retreats = {unit: list(locs) for unit, locs in power.retreats.items()}
        copy.game = clone
        clone.powers[power_name] = copy
    return clone


def fork_game_baseline(game: Game) -> Game:
    """The naive fork (benchmark baseline): deepcopy, which is only correct with `clear_cache()`."""
    import copy
    clone = copy.deepcopy(game)
    clone.clear_cache()
    return clone


def legal_orders(game: Game) -> dict[str, dict[str, list[str]]]:
    """{power: {location: sorted legal orders}} for the powers that have something to order.

    One `get_all_possible_orders()` call for the whole phase; powers with no orderable location
    are left out (they get no prompt)."""
    possible = game.get_all_possible_orders()
    out = {}
    for power_name in POWERS:
        locations = game.get_orderable_locations(power_name)  # sorted by the engine
        per_loc = {loc: sorted(possible[loc]) for loc in locations if possible.get(loc)}
        if per_loc:
            out[power_name] = per_loc
    return out


def legal_orders_baseline(game: Game, power_name: str) -> dict[str, list[str]]:
    """The naive per-power lookup (benchmark baseline): one `get_all_possible_orders()` per power."""
    possible = game.get_all_possible_orders()
    return {loc: sorted(possible[loc]) for loc in game.get_orderable_locations(power_name) if possible.get(loc)}


def engine_order(order: str, game_map, memo: dict[str, str]) -> str:
    """A legal order in the form `set_orders(expand=True)` would store, for `expand=False`.

    Expansion is ~10x slower than the rest of `set_orders`; for orders taken from
    `get_all_possible_orders()` its only effect is on the coast of a supported move's destination:
    an army's support drops it, a fleet's support to a fleet keeps only a coast the supported fleet
    is forced to. Without this, 27 of 1,315 random phases stored different orders (the notes' 5 of
    347). A pure function of the string and the map, so `memo` can live as long as the map.
    Checked identical (orders and outcomes) to expand=True on 5,337 phases; see tests."""
    out = memo.get(order)
    if out is None:
        words = order.split()
        if len(words) == 7 and words[2] == "S" and "/" in words[6]:
            if words[3] == "A":
                words[6] = words[6][:3]
            elif words[0] == "F":
                words = words[:3] + game_map.default_coast(words[3:6] + [words[6][:3]])
        out = memo[order] = " ".join(words)
    return out


def centre_counts(game: Game) -> dict[str, int]:
    return {name: len(game.powers[name].centers) for name in POWERS}


def centre_owners(game: Game) -> tuple:
    """Hashable snapshot of who owns which centre (for stall detection)."""
    return tuple(tuple(sorted(game.powers[name].centers)) for name in POWERS)


_PHASE_RE = re.compile(r"^[SFW](\d{4})[MRA]$")
_SEASONS = {"S": 0, "F": 1, "W": 2}
_TYPES = {"M": 0, "R": 1, "A": 2}


def phase_key(phase: str) -> tuple[int, int, int]:
    """Sortable (year, season, type) of a short phase name such as 'F1905M'."""
    if phase == "COMPLETED":
        return (10**6, 0, 0)
    return (int(phase[1:5]), _SEASONS[phase[0]], _TYPES[phase[-1]])


def new_game(game_id: str | None = None) -> Game:
    """A game at the opening (S1901M) with the package's default rules (id: random unless given)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Game(game_id=game_id) if game_id else Game()


# ----------------------------------------------------------------------------------------------
# State cache: JSON lines, one `Game.get_state()` dict per line.

class StateCacheError(ValueError):
    """A state-cache file that cannot be trusted; the message names the file (and line)."""


_REQUIRED_STATE_KEYS = ("name", "units", "centers", "homes")


def check_state(state, where: str) -> None:
    """Raise StateCacheError unless `state` looks like a `Game.get_state()` of the standard map."""
    if not isinstance(state, dict):
        raise StateCacheError(f"{where}: expected a JSON object (a Game.get_state() dict), got {type(state).__name__}")
    missing = [k for k in _REQUIRED_STATE_KEYS if k not in state]
    if missing:
        raise StateCacheError(f"{where}: missing keys {missing}")
    if not isinstance(state["name"], str) or not _PHASE_RE.match(state["name"]):
        raise StateCacheError(f"{where}: bad phase name {state['name']!r}")
    if state["name"].endswith("R"):  # set_state does not restore dislodged units
        raise StateCacheError(f"{where}: retreat phase {state['name']} cannot be restored; cache M or A phases")
    for key in ("units", "centers", "homes"):
        value = state[key]
        if not isinstance(value, dict) or set(value) != set(POWERS) or \
                not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in value.values()):
            raise StateCacheError(f"{where}: '{key}' must map the 7 powers to lists of strings")


def load_state_cache(path: str) -> list[dict]:
    """States of a cache file, checked line by line and by a trial load of each into a `Game`."""
    if not os.path.isfile(path):
        raise StateCacheError(f"state cache {path}: no such file")
    states = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"state cache {path} line {number}"
            try:
                state = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise StateCacheError(f"{where}: not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None
            check_state(state, where)
            try:
                game = game_from_state(state)
            except Exception as exc:  # the package raises assorted types on bad input
                raise StateCacheError(f"{where}: the diplomacy engine rejected it ({exc!r})") from None
            if game.error:
                raise StateCacheError(f"{where}: the diplomacy engine reported {game.error[:3]}")
            states.append(state)
    if not states:
        raise StateCacheError(f"state cache {path}: contains no states")
    return states


def game_from_state(state: dict) -> Game:
    """A fresh game set to `state` (board exact for movement and adjustment phases; no history)."""
    game = new_game()
    game.set_state(state)
    return game


def save_state_cache(path: str, states: list[dict]) -> None:
    """Write states as JSON lines, atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for state in states:
            f.write(json.dumps(state, sort_keys=True, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
