"""Rollout worker: drive an Env with an Engine until enough groups finish, then build one batch.

The requests of all live games share the engine's batch (continuous batching across games), never
one call per game. With a phase barrier (default) every round is one phase of every live game and
lasts as long as its longest completion; with `rollout.stream` each game submits its next phase as
soon as its current one is answered (`collect` says how). Advantages are normalized per group key.

Stragglers: with `oversample` > 0 the worker keeps `groups_per_batch + oversample` groups in play
and returns as soon as `groups_per_batch` of them are complete; the slow ones keep playing in the
next call and join a later batch (their samples keep the adapter version that sampled them, so
the learner's lag budget still applies). At most `oversample` complete groups wait in a buffer, so
memory stays bounded. With `oversample` = 0 every call plays exactly its own groups to the end
(what resume-exactness relies on).

No drain (`inflight`, `rollout.update=inflight`): a call returns as soon as `groups_per_batch`
groups are complete, with requests still in flight; they keep running in the engine (and through
the adapter update the loop applies between batches) and their groups join a later batch. Every
completed group is replaced at once, so `groups_per_batch + oversample` groups stay live and the
engine stays as full as that; polls stream. Nothing is lost or played twice: the in-flight tickets
belong to the worker, not to one call.

Reward shaping and filtering, for any env, as each group completes: `overlong_buffer` > 0 applies
DAPO's soft length penalty (`overlong_penalty`) to every sample's reward, and `drop_uniform` drops
groups whose rewards are all equal (zero advantage everywhere: no signal), counts them, and starts
new groups until the batch is full (DAPO's dynamic sampling). So that an env that only ever gives
uniform groups cannot spin forever, after `DROP_LIMIT` batches' worth of dropped groups in one call
the rest are kept (and counted).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from colocate.config_schema import Config
from colocate.data import Sample, TrajectoryBatch, build_batch, group_advantages
from colocate.engine.base import Engine
from colocate.envs.base import Env
from colocate.envs.protocol import ResultCheck
from colocate.metrics import percentiles
from colocate.topology import Topology

DROP_LIMIT = 8  # batches' worth of uniform groups one collect may drop before it keeps them


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft length penalty: 0 up to max_new_tokens - buffer tokens, then falling linearly to
    -1 at max_new_tokens (and -1 past it); 0 when buffer is 0."""
    if buffer <= 0:
        return 0.0
    over = length - (max_new_tokens - buffer)
    return -min(max(over, 0) / buffer, 1.0)


def is_uniform(samples: list[Sample]) -> bool:
    """Whether every group key's anchors share one reward (every advantage is then zero)."""
    rewards: dict = {}
    for s in samples:
        if s.is_anchor:
            rewards.setdefault(s.group_key, set()).add(s.reward)
    return all(len(r) <= 1 for r in rewards.values())


def version_stats(samples: list[Sample]) -> dict[str, float]:
    """How far adapter updates reached into the samples: version_span (mean and max of last - first
    token version), the share of samples an update landed in, and tokens_after_update (tokens sampled
    by a newer version than their sample's first token; counted where the engine records each token's
    version, the HF engine)."""
    spans = [s.completion.newest_version - s.completion.version for s in samples]
    after = sum(sum(v > tv[0] for v in tv) for s in samples if (tv := s.completion.token_versions))
    return {"version_span": sum(spans) / max(len(spans), 1), "version_span_max": float(max(spans, default=0)),
            "samples_spanning_update": sum(x > 0 for x in spans) / max(len(spans), 1),
            "tokens_after_update": float(after)}


def group_of(sample: Sample):
    """The env group a sample came from: its group key, or the key's first part (Diplomacy keys
    are (group, power))."""
    key = sample.group_key
    return key[0] if isinstance(key, tuple) else key


@dataclass
class _Play:
    """What one `collect` call has in flight, and its timings."""
    t0: float = field(default_factory=time.perf_counter)
    poll_s: list = field(default_factory=list)        # one engine poll (barrier: one phase of every live game)
    request_s: list = field(default_factory=list)     # per request: submit -> completion handed back
    group_s: dict = field(default_factory=dict)       # group key -> seconds until its samples were complete
    dropped_uniform: int = 0                          # groups dropped for equal rewards
    kept_uniform: int = 0                             # ... kept past DROP_LIMIT
    out_tokens: int = 0
    requests: int = 0


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """How a `RolloutWorker` plays (the module docstring says what each does); `from_config` fills it
    from a run's config once per inference rank, tests and benchmarks set what they exercise."""
    groups_per_batch: int
    """This rank's groups per batch (its share of rollout.groups_per_step)."""
    first_group_id: int = 0
    """Group ids count up from here (unique across ranks)."""
    oversample: int = 0
    stream: bool = False
    drop_uniform: bool = False
    overlong_buffer: int = 0
    max_new_tokens: int = 0
    """What `overlong_buffer`'s penalty counts back from (engine.max_new_tokens)."""
    max_env_errors: int = 100
    """Bad results of the env's methods tolerated (`ResultCheck`) before the rollout fails."""
    inflight: bool = False
    """rollout.update=inflight: no drain; implies streamed polls."""

    @classmethod
    def from_config(cls, cfg: Config, topo: Topology) -> "RolloutSettings":
        return cls(groups_per_batch=topo.share(cfg.rollout.groups_per_step), first_group_id=topo.rank * 1_000_000,
                   oversample=cfg.rollout.oversample_groups, stream=cfg.rollout.stream,
                   drop_uniform=cfg.rollout.drop_uniform_groups, overlong_buffer=cfg.env.overlong_buffer,
                   max_new_tokens=cfg.engine.max_new_tokens, max_env_errors=cfg.env.max_reward_errors,
                   inflight=cfg.rollout.update == "inflight")


class RolloutWorker:
    def __init__(self, env: Env, engine: Engine, settings: RolloutSettings):
        self.env = env
        self.check = ResultCheck(env, settings.max_env_errors)  # what the env's methods return
        self.engine = engine
        self.settings = settings
        self.stream = settings.stream or settings.inflight  # no drain: a poll must leave unfinished requests running
        self.next_group = settings.first_group_id
        self._live: set = set()                    # groups started and not yet complete
        self._complete: dict = {}                  # group -> its samples, in completion order
        self._in_flight: dict = {}                 # ticket -> (env key, submit time); across calls when inflight
        self._keys_in_flight: set = set()          # their env keys

    def collect(self) -> tuple[TrajectoryBatch, dict[str, float], dict[str, float]]:
        """Play until `groups_per_batch` groups are complete -> (batch, rollout stats, engine stats).

        Every waiting request goes to the engine (`submit`) as soon as its game can play it; each
        `poll` hands back what finished and the env steps those games. Phase barrier (`stream`
        off): a poll waits for every request in flight, so each round is one phase of every live
        game. Streaming: a poll returns as soon as any request finished, so a game moves on
        without waiting for the slowest completion of the round. Drain (default): nothing is in
        flight when this returns, so adapter updates find the engine idle. `inflight`: it returns
        once the groups are complete; what is in flight keeps running into the next call."""
        play = _Play()
        self._start_groups()
        while len(self._complete) < self.settings.groups_per_batch or (self._in_flight and not self.settings.inflight):
            if len(self._complete) < self.settings.groups_per_batch:  # past it: only drain what is in flight
                self._start_groups()  # again after a drop or (inflight) a completed group
                self._submit_waiting(play)
            self._file_finished(self._advance(play), play)
        if self.settings.inflight:  # replace the groups just completed: the engine stays full while the batch ships
            self._start_groups()
            self.env.settle()  # an env working in other processes: their first requests, before shipping
            self._submit_waiting(play)
        samples = self._take_samples()
        batch = build_batch(samples, group_advantages(samples))
        elapsed = time.perf_counter() - play.t0
        return batch, self._rollout_stats(batch, samples, play, elapsed), self._engine_stats(play, elapsed)

    def _start_groups(self) -> None:
        """Keep `groups_per_batch + oversample` groups in play (live or complete and waiting); with
        `inflight`, that many live: a completed group is replaced at once."""
        waiting = 0 if self.settings.inflight else len(self._complete)
        while len(self._live) + waiting < self.settings.groups_per_batch + self.settings.oversample:
            self.env.start_group(self.next_group)
            self._live.add(self.next_group)
            self.next_group += 1

    def _submit_waiting(self, play: _Play) -> None:
        """Submit every request the env has waiting that is not already in flight (with a phase
        barrier, once the env has settled: a round is every live game's phase, whole)."""
        if not self.stream:
            self.env.settle()
        waiting = self.check.requests(self.env.requests(), known=self._keys_in_flight)
        if not waiting:
            return
        now = time.perf_counter()
        for ticket, (k, _) in zip(self.engine.submit([r for _, r in waiting]), waiting):
            self._in_flight[ticket] = (k, now)
            self._keys_in_flight.add(k)
        play.requests += len(waiting)

    def _advance(self, play: _Play) -> list[Sample]:
        """Poll the engine and step the env with what it answered -> samples of groups that finished
        (with nothing in flight, what the env has finished without the engine, once it has settled)."""
        if not self._in_flight:
            self.env.settle()  # an env working in other processes: wait for what it owes
            finished = self.check.samples(self.env.pop_finished())
            if not finished and not self.check.requests(self.env.requests()):
                raise RuntimeError(f"env has no requests and {len(self._live)} unfinished groups")
            return finished
        t = time.perf_counter()
        # streamed: back as soon as the env has new requests or samples, not only the engine
        done = self.engine.poll(wait_all=False, wake=self.env.has_news) if self.stream else \
            self.engine.poll(wait_all=True)
        now = time.perf_counter()
        play.poll_s.append(now - t)
        answers = {}
        for ticket, completion in done:
            key, t_submit = self._in_flight.pop(ticket)
            self._keys_in_flight.discard(key)
            answers[key] = completion
            play.request_s.append(now - t_submit)
            play.out_tokens += len(completion.token_ids)
        self.env.step(answers)
        return self.check.samples(self.env.pop_finished())

    def _file_finished(self, finished: list[Sample], play: _Play) -> None:
        """Shape the finished samples' rewards, drop uniform groups, file the rest as complete."""
        now = time.perf_counter() - play.t0
        groups: dict = {}
        for s in finished:
            s.reward += overlong_penalty(len(s.completion.token_ids), self.settings.max_new_tokens,
                                         self.settings.overlong_buffer)
            play.group_s.setdefault(s.group_key, now)
            groups.setdefault(group_of(s), []).append(s)
            self._live.discard(group_of(s))
        for g, samples in groups.items():
            if self.settings.drop_uniform and is_uniform(samples):
                if play.dropped_uniform < DROP_LIMIT * self.settings.groups_per_batch:
                    play.dropped_uniform += 1
                    continue
                play.kept_uniform += 1
            self._complete.setdefault(g, []).extend(samples)

    def _take_samples(self) -> list[Sample]:
        """The samples of the first `groups_per_batch` complete groups (the rest wait for a later batch)."""
        taken = list(self._complete)[: self.settings.groups_per_batch]
        return [s for g in taken for s in self._complete.pop(g)]

    def _rollout_stats(self, batch: TrajectoryBatch, samples: list[Sample], play: _Play,
                       elapsed: float) -> dict[str, float]:
        return {
            "reward": float(batch.rewards.mean()) if samples else 0.0,
            "samples": float(len(samples)),
            "polls": float(len(play.poll_s)),
            "latency_s": elapsed,
            "games_per_s": self.settings.groups_per_batch * self.env.group_size / max(elapsed, 1e-9),
            **percentiles(play.poll_s, "poll_latency_s"),
            **percentiles(play.request_s, "request_latency_s"),
            **percentiles(list(play.group_s.values()), "group_latency_s"),
            "groups_carried_over": float(len(self._live) + len(self._complete)),
            "requests_in_flight": float(len(self._in_flight)),  # carried into the next call (inflight)
            **version_stats(samples),
            "dropped_uniform_groups": float(play.dropped_uniform),
            "kept_uniform_groups": float(play.kept_uniform),
            "env_errors": float(self.check.take_errors()),
            **{k: float(v) for k, v in self.env.metrics().items()},
        }

    def _engine_stats(self, play: _Play, elapsed: float) -> dict[str, float]:
        """Streamed, the engine (its own process) keeps working while this thread steps the env: its
        tokens/s are over the whole collect, and generate_fraction is the share spent blocked in poll."""
        gen_time = sum(play.poll_s)  # time blocked in the engine (host work overlaps it when streaming)
        return {
            "out_tokens": float(play.out_tokens),
            "out_tokens_per_s": play.out_tokens / max(elapsed if self.stream else gen_time, 1e-9),
            "requests_per_call": play.requests / max(len(play.poll_s), 1),  # streamed: submissions per poll
            "generate_fraction": gen_time / max(elapsed, 1e-9),
            **self.engine.stats(),
        }
