"""`DiplomacyEnv`: GRPO groups of forked Diplomacy continuations behind the `Env` protocol.

A group is G continuations forked (`game.fork_game`) from one start state: the opening, or a
random line of the state cache (`env.state_cache`). In every phase of every continuation each
power with something to order gets one prompt; `requests()` returns all of them across all games,
so the worker makes one engine call per phase. `step()` parses each completion into legal orders
(`orders.py`; the rest hold and are counted), and once all powers of a continuation have answered
the phase is processed (`unit_labels=False`: each line leaves out its unit, named by the line's
position; prompt.py says why). A continuation ends `horizon_years` years after the fork phase
(S1903M forked with horizon 2 ends on reaching S1905M), when the game is over, or early when no
supply centre changed owner for `stall_years` years.

Reward of power p in a continuation (computed when it ends):

    reward_p = (C_p(end) - C_p(fork)) / 3 + 0.5 * [p has a unit or a centre at the end]

C_p = supply centres of p; 3 ~ a power's starting centres, so one centre gained is worth 1/3 and
being eliminated costs 0.5 on top of the lost centres. The worker normalizes advantages per power
within the group, so the scale only matters for logs and unnormalized variants.

Trained decisions: each power's orders at the fork phase, `Sample.group_key = (group_id, power)`,
`is_anchor=True` (all G continuations share that state, so each key has G anchors). With
`train_later_phases`, the power's later-phase orders are returned too, `is_anchor=False`, with the
same key and its continuation's reward (they receive that continuation's advantage).

The legal orders, slots, prompts and constraints of a phase are built once per game phase
(`PhaseView`) and shared by the 7 powers; at the fork phase also by the G continuations.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import ClassVar, Hashable

from colocate.chat import ChatFormat
from colocate.data import Completion, Request, Sample
from colocate.config_checks import ConfigError
from colocate.envs.base import Env, weighted_mean
from colocate.envs.checks import KeyRules
from colocate.envs.diplomacy import game as dg
from colocate.envs.diplomacy.orders import parse_orders
from colocate.envs.diplomacy.prompt import (CORPUS_VERSION, PowerOrders, TokenCache, board_lines, corpus, instruction,
                                            max_completion_tokens, opening_texts, own_lines, power_orders)

CENTRE_SCALE = 3.0
SURVIVAL_BONUS = 0.5


def power_rewards(start_centres: dict[str, int], game) -> dict[str, float]:
    """The module docstring's formula, for every power."""
    out = {}
    for name in dg.POWERS:
        power = game.powers[name]
        alive = bool(power.units or power.centers)
        out[name] = (len(power.centers) - start_centres[name]) / CENTRE_SCALE + SURVIVAL_BONUS * alive
    return out


def pooled_std(parts: list[dict], mean: str, std: str, weight: str) -> float:
    """The (population) standard deviation over all parts: E[x^2] minus the pooled mean squared."""
    square = sum(p[weight] * (p[std] ** 2 + p[mean] ** 2) for p in parts) / max(sum(p[weight] for p in parts), 1)
    return max(square - weighted_mean(parts, mean, weight) ** 2, 0.0) ** 0.5


@dataclass
class PhaseView:
    """One game phase as the policy sees it; shared by every continuation in that exact state."""
    phase: str
    orders: dict[str, PowerOrders]
    requests: dict[str, Request]


@dataclass
class Continuation:
    game: object
    view: PhaseView | None
    start_centres: dict[str, int]
    end_key: tuple[int, int, int]
    last_change_year: int
    owners: tuple
    answers: dict[str, list[str]] = field(default_factory=dict)
    decisions: list[tuple[int, str, list[int], Completion, int]] = field(default_factory=list)
    """(phase index, power, prompt ids, completion, invalid slots) of the decisions to train."""
    num_phases: int = 0
    rewards: dict[str, float] | None = None
    end_reason: str = ""


@dataclass
class Group:
    group_id: int
    fork_phase: str
    continuations: list[Continuation]


@dataclass(frozen=True, kw_only=True)
class DiplomacySettings:
    """How a `DiplomacyEnv` plays (the module docstring; `from_config`: a run's env keys). The defaults
    are a short game for tests and benchmarks: one year, room for a whole order list."""
    KEYS: ClassVar[KeyRules] = {"horizon_years": (lambda v: v >= 1, "must be >= 1"),
                                "stall_years": (lambda v: v >= 1, "must be >= 1")}
    """The env.* keys it is built from that have a range (`DiplomacyEnv.check` holds them)."""

    group_size: int
    """Continuations forked from one start state (rollout.group_size)."""
    horizon_years: int = 1
    stall_years: int = 2
    train_later_phases: bool = False
    use_constraint: bool = True
    unit_labels: bool = True
    list_supports: bool = True
    max_new_tokens: int = 256
    temperature: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> "DiplomacySettings":
        e = cfg.env
        return cls(group_size=cfg.rollout.group_size, horizon_years=e.horizon_years, stall_years=e.stall_years,
                   train_later_phases=e.train_later_phases, use_constraint=e.use_constraint,
                   unit_labels=e.unit_labels, list_supports=e.list_supports,
                   max_new_tokens=cfg.engine.max_new_tokens, temperature=cfg.engine.temperature)


class DiplomacyEnv(Env):
    KEYS = DiplomacySettings.KEYS
    @classmethod
    def prompt_bound(cls, cfg) -> int:
        """The longest board and order list of the mid-game states, with room to spare."""
        return 1536

    @classmethod
    def requests_per_group(cls, cfg) -> int:
        """Every continuation asks for all seven powers' orders in each phase."""
        return cfg.rollout.group_size * len(dg.POWERS)

    def __init__(self, tokenizer, settings: DiplomacySettings, *, seed: int = 0, start_states: list[dict] | None = None,
                 chat: ChatFormat | None = None):
        """`seed`: this rank's (start states, fork choices); `start_states`: saved game states a group
        forks from (`env.state_cache`), None: the opening."""
        if settings.horizon_years < 1:
            raise ValueError(f"horizon_years={settings.horizon_years} must be >= 1")
        self.tokenizer = tokenizer
        self.chat = chat or ChatFormat(tokenizer, "none")  # wraps the memoized prompt ids in the template
        self.settings, self.group_size = settings, settings.group_size
        self.start_states = start_states
        self.rng = random.Random(seed)
        self.eos_id = tokenizer.eos_token_id
        self.tokens = TokenCache(tokenizer, sample_texts=opening_texts(settings.unit_labels, settings.list_supports),
                                 instruction_text=instruction(settings.unit_labels, settings.list_supports))
        self._engine_orders: dict[str, str] = {}
        self._groups: dict[int, Group] = {}
        self._reset_counters()

    @classmethod
    def preflight(cls, cfg) -> None:
        """env.state_cache: the file exists and every line is a saved game state."""
        if not cfg.env.state_cache:
            return
        try:
            dg.load_state_cache(cfg.env.state_cache)
        except (OSError, dg.StateCacheError) as e:
            raise ConfigError(f"env.state_cache={cfg.env.state_cache!r}: {e}") from None

    @classmethod
    def corpus_key(cls, cfg) -> str:
        return f"diplomacy-{CORPUS_VERSION}"

    @classmethod
    def corpus(cls, cfg) -> list[str]:
        return corpus()

    @classmethod
    def from_config(cls, cfg, tokenizer, seed: int) -> "DiplomacyEnv":
        path = cfg.env.state_cache
        return cls(tokenizer, DiplomacySettings.from_config(cfg), seed=seed,
                   start_states=dg.load_state_cache(path) if path else None,
                   chat=ChatFormat(tokenizer, cfg.model.chat_template))

    # ------------------------------------------------------------------ Env protocol

    def start_group(self, group_id: int) -> None:
        if group_id in self._groups:
            raise ValueError(f"group {group_id} already started")
        root = dg.game_from_state(self.rng.choice(self.start_states)) if self.start_states else dg.new_game()
        view = self._build_view(root)
        key = dg.phase_key(root.get_current_phase())
        end_key = (key[0] + self.settings.horizon_years, key[1], key[2])
        centres, owners = dg.centre_counts(root), dg.centre_owners(root)
        t0 = time.perf_counter()
        games = [dg.fork_game(root) for _ in range(self.group_size)]
        self._count["fork_s"] += time.perf_counter() - t0
        self._count["forks"] += len(games)
        conts = [Continuation(game=g, view=view, start_centres=centres, end_key=end_key,
                              last_change_year=key[0], owners=owners) for g in games]
        self._groups[group_id] = Group(group_id, root.get_current_phase(), conts)
        for cont in conts:
            if not view.requests:  # nothing to order (cannot happen at a cached M/A phase; be safe)
                self._finish(cont, "no_orders")

    def requests(self) -> list[tuple[Hashable, Request]]:
        out = []
        for group in self._groups.values():
            for index, cont in enumerate(group.continuations):
                if cont.rewards is not None:
                    continue
                if cont.view is None:
                    cont.view = self._build_view(cont.game)
                for power, request in cont.view.requests.items():
                    if power not in cont.answers:
                        out.append(((group.group_id, index, power), request))
        return out

    def step(self, completions: dict[Hashable, Completion]) -> None:
        touched = []
        t0 = time.perf_counter()
        for key, completion in completions.items():
            group_id, index, power = key
            cont = self._groups[group_id].continuations[index]
            if cont.rewards is not None or cont.view is None or power not in cont.view.requests \
                    or power in cont.answers:
                raise KeyError(f"completion for {key} was not requested")
            orders = cont.view.orders[power]
            parsed = self.parse(completion, orders)
            cont.answers[power] = parsed.orders
            self._count["completions"] += 1
            self._count["slots"] += orders.num_slots
            self._count["invalid"] += parsed.num_invalid
            self._count["garbled_lines"] += parsed.num_garbled
            self._count["truncated"] += completion.finish_reason == "length"
            if cont.num_phases == 0 or self.settings.train_later_phases:
                cont.decisions.append((cont.num_phases, power, cont.view.requests[power].prompt_ids,
                                       completion, parsed.num_invalid))
            if len(cont.answers) == len(cont.view.requests):
                touched.append(cont)
        self._count["parse_s"] += time.perf_counter() - t0
        for cont in touched:
            self._advance(cont)

    def pop_finished(self) -> list[Sample]:
        out = []
        for group_id in [g for g, grp in self._groups.items()
                         if all(c.rewards is not None for c in grp.continuations)]:
            group = self._groups.pop(group_id)
            for index, cont in enumerate(group.continuations):
                for phase_index, power, prompt_ids, completion, invalid in cont.decisions:
                    out.append(Sample(
                        prompt_ids=prompt_ids, completion=completion, reward=cont.rewards[power],
                        group_key=(group_id, power), is_anchor=phase_index == 0,
                        info={"power": power, "phase_index": phase_index, "continuation": index,
                              "fork_phase": group.fork_phase, "invalid_slots": invalid,
                              "sc_delta": len(cont.game.powers[power].centers) - cont.start_centres[power]}))
        return out

    def metrics(self) -> dict[str, float]:
        c = self._count
        deltas = self._sc_deltas
        out = {
            "invalid_order_rate": c["invalid"] / max(c["slots"], 1),
            "garbled_lines_per_completion": c["garbled_lines"] / max(c["completions"], 1),
            "truncated_rate": c["truncated"] / max(c["completions"], 1),
            "completions": float(c["completions"]),
            "order_slots": float(c["slots"]),
            "prompts": float(c["prompts"]),
            "views": float(c["views"]),
            "forks": float(c["forks"]),
            "phases_processed": float(c["phases"]),
            "continuations_finished": float(len(self._end_centres)),
            "sc_deltas": float(len(deltas)),
            "stall_stops": float(c["stall_stops"]),
            "prompt_tokens_mean": c["prompt_tokens"] / max(c["prompts"], 1),
            "prompt_tokens_max": float(c["prompt_tokens_max"]),
            "orders_tokens_max": float(c["orders_tokens_max"]),
            "fork_ms": 1e3 * c["fork_s"] / max(c["forks"], 1),
            "build_ms_per_phase": 1e3 * c["build_s"] / max(c["views"], 1),
            "process_ms_per_phase": 1e3 * c["process_s"] / max(c["phases"], 1),
            "parse_ms_per_completion": 1e3 * c["parse_s"] / max(c["completions"], 1),
        }
        if deltas:
            mean = sum(deltas) / len(deltas)
            out["sc_delta_mean"] = mean
            out["sc_delta_std"] = (sum((d - mean) ** 2 for d in deltas) / len(deltas)) ** 0.5
            out["sc_delta_max"] = float(max(deltas))
            out["sc_mean"] = sum(self._end_centres) / len(self._end_centres) / len(dg.POWERS)
        self._reset_counters()
        return out

    MEAN_OVER = {"invalid_order_rate": "order_slots", "garbled_lines_per_completion": "completions",
                 "truncated_rate": "completions", "parse_ms_per_completion": "completions",
                 "prompt_tokens_mean": "prompts", "fork_ms": "forks", "build_ms_per_phase": "views",
                 "process_ms_per_phase": "phases_processed", "sc_delta_mean": "sc_deltas",
                 "sc_mean": "continuations_finished"}
    COUNTS = ("stall_stops",)

    @classmethod
    def merge_metrics(cls, parts: list[dict[str, float]]) -> dict[str, float]:
        """`Env.merge_metrics` by `MEAN_OVER` and `COUNTS`, with the spread of centre changes pooled:
        what one env would have reported."""
        out = super().merge_metrics(parts)
        if have := [p for p in parts if "sc_delta_std" in p]:
            out["sc_delta_std"] = pooled_std(have, "sc_delta_mean", "sc_delta_std", "sc_deltas")
        return out

    # ------------------------------------------------------------------ internals

    def _reset_counters(self) -> None:
        self._count = dict.fromkeys(
            ("completions", "slots", "invalid", "garbled_lines", "truncated", "phases", "stall_stops",
             "prompts", "prompt_tokens", "prompt_tokens_max", "orders_tokens_max", "views", "forks",
             "fork_s", "build_s", "process_s", "parse_s"), 0)
        self._sc_deltas: list[int] = []      # per (finished continuation, power alive at the fork)
        self._end_centres: list[int] = []    # total centres owned per finished continuation

    def _build_view(self, game) -> PhaseView:
        t0 = time.perf_counter()
        all_orders = power_orders(game, dg.legal_orders(game))
        board_ids = self.tokens.encode("".join(board_lines(game)))
        requests = {}
        for power, orders in all_orders.items():
            requests[power] = request = self.request(board_ids, orders, self.settings.temperature)
            prompt_ids = request.prompt_ids
            if request.constraint is not None:
                needed = max_completion_tokens(request.constraint)
                self._count["orders_tokens_max"] = max(self._count["orders_tokens_max"], needed)
            self._count["prompts"] += 1
            self._count["prompt_tokens"] += len(prompt_ids)
            self._count["prompt_tokens_max"] = max(self._count["prompt_tokens_max"], len(prompt_ids))
        self._count["views"] += 1
        self._count["build_s"] += time.perf_counter() - t0
        return PhaseView(game.get_current_phase(), all_orders, requests)

    def request(self, board_ids: list[int], orders: PowerOrders, temperature: float) -> Request:
        """One power's prompt (board_ids: the phase's encoded `board_lines`), under the legal-order
        constraint when the env uses it; training and evaluation ask alike."""
        prompt_ids = self.chat.wrap(self.tokens.prompt_ids(board_ids, own_lines(orders, self.settings.list_supports)))
        constraint, max_new = None, self.settings.max_new_tokens
        if self.settings.use_constraint:
            constraint = self.tokens.constraint(orders, self.eos_id, self.settings.unit_labels)
            max_new = min(max_new, max_completion_tokens(constraint))
        return Request(prompt_ids=prompt_ids, max_new_tokens=max_new, temperature=temperature, constraint=constraint)

    def parse(self, completion: Completion, orders: PowerOrders):
        """Completion -> `orders.ParsedOrders` (legal orders, invalid slots, garbled lines)."""
        ids = [t for t in completion.token_ids if t != self.eos_id]
        return parse_orders(self.tokenizer.decode(ids), orders, self.settings.unit_labels)

    def evaluate(self, engine, eval_cfg, out_dir: str | None = None) -> dict[str, float]:
        """The policy against fixed opponents (`evaluate.py`); saved games and boards under out_dir."""
        from colocate.envs.diplomacy.evaluate import evaluate
        return evaluate(self, engine, eval_cfg, out_dir)

    def _advance(self, cont: Continuation) -> None:
        """Submit the collected orders, process the phase, and decide whether the continuation ends."""
        t0 = time.perf_counter()
        game = cont.game
        for power, orders in cont.answers.items():
            game.set_orders(power, [dg.engine_order(o, game.map, self._engine_orders) for o in orders],
                            expand=False)
        game.process()
        self._count["process_s"] += time.perf_counter() - t0
        self._count["phases"] += 1
        cont.num_phases += 1
        cont.answers = {}
        cont.view = None
        if game.is_game_done:
            return self._finish(cont, "game_over")
        key = dg.phase_key(game.get_current_phase())
        owners = dg.centre_owners(game)
        if owners != cont.owners:
            cont.owners, cont.last_change_year = owners, key[0]
        if key >= cont.end_key:
            return self._finish(cont, "horizon")
        if self.settings.stall_years > 0 and key[0] - cont.last_change_year >= self.settings.stall_years:
            self._count["stall_stops"] += 1
            return self._finish(cont, "stall")
        return None

    def _finish(self, cont: Continuation, reason: str) -> None:
        cont.rewards = power_rewards(cont.start_centres, cont.game)
        cont.end_reason = reason
        cont.view = None
        centres = dg.centre_counts(cont.game)
        for name in dg.POWERS:
            if cont.start_centres[name] > 0:
                self._sc_deltas.append(centres[name] - cont.start_centres[name])
        self._end_centres.append(sum(centres.values()))


def random_legal_completion(request: Request, rng: random.Random) -> Completion:
    """What a uniformly random legal policy would sample: one random choice per slot, then EOS.

    The reference opponent of the learning check and the policy of the env benchmark; needs the
    constraint (use_constraint=True)."""
    constraint = request.constraint
    ids: list[int] = []
    for slot in constraint.slots:
        ids.extend(rng.choice(slot))
    ids.append(constraint.eos_id)
    return Completion(token_ids=ids, logprobs=[0.0] * len(ids), allowed_ids=None, version=0)
