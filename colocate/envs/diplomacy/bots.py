"""Fixed opponents for evaluation: `random`, `hold` and `greedy`, deciding on the host.

Every bot answers one power's `PowerOrders` (prompt.py: slots in prompt order, each with its sorted
legal orders) with legal orders only, so the engine never drops one:
  * `random`: one uniform choice per slot; builds and disbands on distinct sites.
  * `hold`: every unit holds; it orders nothing in retreat and adjustment phases, so the engine
    disbands its dislodged units, builds nothing, and disbands by its civil-disorder rule.
  * `greedy`: a rule bot in the spirit of DumbBot, written from the rules and the package's map.
    Each supply centre gets a value for this power (neutral and enemy centres to take, own centres
    by how many enemy units can reach them); a location is worth the centres near it, discounted
    per move (`Geography`). Units take the best-valued targets one unit per province, never
    swapping or bouncing each other; units left idle support contested attacks, then threatened
    units; retreats and builds go where the value is highest, disbands where it is lowest.
    Convoys are left out. A little seeded noise breaks ties, as DumbBot's randomness does.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from colocate.envs.diplomacy.game import POWERS
from colocate.envs.diplomacy.prompt import BUILD, DISBAND, RETREAT, PowerOrders

NEUTRAL_VALUE = 5.0    # a neutral centre: the cheapest to take
ENEMY_VALUE = 4.0      # an enemy's centre: usually defended
DEFEND_VALUE = 3.0     # an own centre, per enemy unit that can reach it
DECAY = 0.2           # a centre k moves away counts DECAY ** k
MAX_DISTANCE = 4       # centres further away than this count nothing
NOISE = 0.05           # seeded tie-breaking noise on each move's score
SUPPORT_SHARE = 0.6    # a unit supports an attack when its own best move is worth less than this share


@dataclass(frozen=True)
class Geography:
    """One map's distances per unit type, from the package's adjacency (`Map.abuts`)."""
    adjacent: dict   # (unit type, loc) -> tuple of locs one move away
    near: dict       # (unit type, loc) -> ((centre province, DECAY ** moves), ...) within MAX_DISTANCE
    reach: dict      # (unit type, loc) -> frozenset of provinces it can hold or move into


@lru_cache(maxsize=4)
def geography(game_map) -> Geography:
    """Built once per map object (the package shares one map per map name)."""
    adjacent, near, reach = {}, {}, {}
    centres = sorted(game_map.scs)
    for kind in "AF":
        locs = sorted({loc.upper() for loc in game_map.locs if game_map.is_valid_unit(f"{kind} {loc.upper()}")})
        nbrs = {a: tuple(b for b in locs if b != a and game_map.abuts(kind, a, "-", b)) for a in locs}
        for start in locs:
            distance = _province_distances(start, nbrs)
            adjacent[(kind, start)] = nbrs[start]
            near[(kind, start)] = tuple((c, DECAY ** distance[c]) for c in centres
                                        if distance.get(c, MAX_DISTANCE + 1) <= MAX_DISTANCE)
            reach[(kind, start)] = frozenset([start[:3], *(b[:3] for b in nbrs[start])])
    return Geography(adjacent, near, reach)


def _province_distances(start: str, nbrs: dict) -> dict[str, int]:
    """Breadth-first moves from `start` to every province (the nearest of its coasts)."""
    seen, frontier, out = {start}, [start], {start[:3]: 0}
    for depth in range(1, MAX_DISTANCE + 1):
        nxt = []
        for loc in frontier:
            for b in nbrs[loc]:
                if b not in seen:
                    seen.add(b)
                    nxt.append(b)
                    out.setdefault(b[:3], depth)
        frontier = nxt
    return out


def unit_parts(unit: str) -> tuple[str, str]:
    """'F STP/SC' -> ('F', 'STP/SC')."""
    return unit[0], unit[2:]


class Bot:
    """One power's orders for the current phase; `rng` is the game's own, so games are seeded."""
    name = ""

    def orders(self, game, orders: PowerOrders, rng: random.Random) -> list[str]:
        raise NotImplementedError


class RandomBot(Bot):
    name = "random"

    def orders(self, game, orders, rng):
        if orders.kind in (BUILD, DISBAND):
            choices = list(orders.choices[0])
            rng.shuffle(choices)
            return distinct_sites(choices, orders.num_slots)
        return [rng.choice(slot) for slot in orders.choices]


class HoldBot(Bot):
    name = "hold"

    def orders(self, game, orders, rng):
        if orders.kind in (BUILD, DISBAND, RETREAT):
            return []
        return [f"{label} H" for label in orders.labels if f"{label} H" in orders.slot_of]


def distinct_sites(ranked: list[str], count: int) -> list[str]:
    """The first `count` adjustment orders of `ranked` on distinct sites (WAIVE may repeat)."""
    out, sites = [], set()
    for order in ranked:
        site = None if order == "WAIVE" else order.split()[1][:3]
        if site is not None and site in sites:
            continue
        out.append(order)
        if site is not None:
            sites.add(site)
        if len(out) == count:
            break
    return out


class GreedyBot(Bot):
    """The module docstring's rule bot; `Valuation` holds one phase's view of the board."""
    name = "greedy"

    def orders(self, game, orders, rng):
        values = Valuation(game, orders.power)
        if orders.kind == BUILD:
            return self._builds(values, orders, reverse=True)
        if orders.kind == DISBAND:
            return self._builds(values, orders, reverse=False)
        if orders.kind == RETREAT:
            return [max(slot, key=lambda o: values.retreat_score(o)) for slot in orders.choices]
        return MovePlan(values, orders, rng).orders()

    @staticmethod
    def _builds(values: "Valuation", orders: PowerOrders, reverse: bool) -> list[str]:
        choices = [o for o in orders.choices[0] if o != "WAIVE"]
        ranked = sorted(choices, key=lambda o: (values.site_value(o.split()[0], o.split()[1]), o), reverse=reverse)
        return distinct_sites(ranked, orders.num_slots) or (["WAIVE"] if reverse else [])


class Valuation:
    """Centre values and threats for `power` in the current phase."""

    def __init__(self, game, power: str):
        self.geo = geography(game.map)
        self.power = power
        self.own_units = list(game.powers[power].units)
        enemy_units = [unit_parts(u) for name in POWERS if name != power for u in game.powers[name].units]
        self.threat: dict[str, int] = {}  # province -> enemy units that can hold or move into it
        for kind, loc in enemy_units:
            for province in self.geo.reach.get((kind, loc), ()):
                self.threat[province] = self.threat.get(province, 0) + 1
        owner = {c: name for name in POWERS for c in game.powers[name].centers}
        self.centre_value = {}
        for centre in game.map.scs:
            holder = owner.get(centre)
            if holder == power:
                self.centre_value[centre] = DEFEND_VALUE * self.threat.get(centre, 0)
            else:
                self.centre_value[centre] = NEUTRAL_VALUE if holder is None else ENEMY_VALUE

    def value(self, kind: str, loc: str) -> float:
        """What standing at `loc` is worth to a unit of `kind`: nearby centres, discounted per move."""
        return sum(self.centre_value[c] * w for c, w in self.geo.near.get((kind, loc), ()))

    def site_value(self, kind: str, loc: str) -> float:
        """A build or disband site: the location and its best neighbour."""
        nbrs = self.geo.adjacent.get((kind, loc), ())
        return self.value(kind, loc) + max((self.value(kind, b) for b in nbrs), default=0.0)

    def retreat_score(self, order: str) -> float:
        words = order.split()
        return self.value(words[0], words[3]) if words[2] == "R" else -1.0


class MovePlan:
    """Movement orders: best targets first, one unit per province, then supports."""

    def __init__(self, values: Valuation, orders: PowerOrders, rng: random.Random):
        self.values = values
        self.units = list(orders.labels)
        self.legal = [set(slot) for slot in orders.choices]
        self.rng = rng
        self.target: dict[str, str] = {}    # unit -> target loc (its own loc = hold)
        self.score: dict[str, float] = {}
        self.support: dict[str, str] = {}   # unit -> its support order

    def orders(self) -> list[str]:
        self._assign_moves()
        self._add_attack_supports()
        self._add_hold_supports()
        out = []
        for i, unit in enumerate(self.units):
            order = self.support.get(unit) or self._move_order(unit, self.target.get(unit))
            out.append(order if order in self.legal[i] else f"{unit} H")
        return out

    def _move_order(self, unit: str, target: str | None) -> str:
        return f"{unit} H" if target is None or target == unit[2:] else f"{unit} - {target}"

    def _candidates(self) -> list[tuple[float, str, str]]:
        """(score, unit, target) for every hold and plain move, best first."""
        out = []
        for i, unit in enumerate(self.units):
            kind, loc = unit_parts(unit)
            for order in self.legal[i]:
                words = order.split()
                if words[2] == "H":
                    target = loc
                elif words[2] == "-" and len(words) == 4:
                    target = words[3]
                else:
                    continue
                score = self.values.value(kind, target) / (1 + self._contest(target, loc))
                out.append((score + NOISE * self.rng.random(), unit, target))
        return sorted(out, reverse=True)

    def _contest(self, target: str, loc: str) -> int:
        """Enemy units that may bounce a move into `target` (a hold is never bounced)."""
        return 0 if target == loc else self.values.threat.get(target[:3], 0)

    def _assign_moves(self) -> None:
        taken: dict[str, str] = {}  # province -> unit going there (or staying)
        at = {unit[2:5]: unit for unit in self.units}
        for _ in range(2):  # a second pass lets a unit follow into a place vacated later in the first
            for score, unit, target in self._candidates():
                province = target[:3]
                if unit in self.target or province in taken:
                    continue
                occupant = at.get(province)
                if occupant not in (None, unit):
                    leaving = self.target.get(occupant)
                    if leaving is None or leaving[:3] == province or leaving[:3] == unit[2:5]:
                        continue  # it stays, has not decided yet, or it would swap with us
                self.target[unit], self.score[unit] = target, score
                taken[province] = unit
        for unit in self.units:
            self.target.setdefault(unit, unit[2:])
            self.score.setdefault(unit, 0.0)

    def _add_attack_supports(self) -> None:
        attacks = [(self.score[u], u) for u in self.units
                   if self.target[u] != u[2:] and self.values.threat.get(self.target[u][:3], 0)]
        for value, mover in sorted(attacks, reverse=True):
            if mover in self.support:
                continue
            province = self.target[mover][:3]
            helpers = [(self.score[h], h) for h in self.units
                       if h != mover and h not in self.support and self.score[h] < SUPPORT_SHARE * value
                       and all(self.target.get(u) != h[2:] for u in self.units if u != h)]
            for _, helper in sorted(helpers):
                legal = self.legal[self.units.index(helper)]
                order = next((o for o in (f"{helper} S {mover} - {province}", f"{helper} S {mover} - {self.target[mover]}")
                              if o in legal), None)
                if order is not None:
                    self.support[helper] = order
                    self.target[helper] = helper[2:]
                    break

    def _add_hold_supports(self) -> None:
        """Units that stay put anyway support a threatened unit that stays too (strength is free)."""
        staying = [u for u in self.units if self.target[u] == u[2:]]
        threatened = sorted(((self.values.threat.get(u[2:5], 0), u) for u in staying), reverse=True)
        for helper in staying:
            if helper in self.support:
                continue
            for threat, unit in threatened:
                order = f"{helper} S {unit}"
                if threat and unit != helper and order in self.legal[self.units.index(helper)]:
                    self.support[helper] = order
                    break


BOTS = {bot.name: bot for bot in (RandomBot, HoldBot, GreedyBot)}


def make_bot(kind: str) -> Bot:
    if kind not in BOTS:
        raise ValueError(f"unknown opponent {kind!r}; expected one of {', '.join(BOTS)}")
    return BOTS[kind]()
