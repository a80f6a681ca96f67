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
"""
from __future__ import annotations

import time

from colocate.data import Sample, TrajectoryBatch, build_batch, group_advantages
from colocate.metrics import percentiles


def group_of(sample: Sample):
    """The env group a sample came from: its group key, or the key's first part (Diplomacy keys
    are (group, power))."""
    key = sample.group_key
    return key[0] if isinstance(key, tuple) else key


class RolloutWorker:
    def __init__(self, env, engine, *, groups_per_batch: int, first_group_id: int = 0, oversample: int = 0,
                 stream: bool = False):
        self.env = env
        self.engine = engine
        self.groups_per_batch = groups_per_batch
        self.oversample = oversample
        self.stream = stream
        self.next_group = first_group_id
        self._live: set = set()                    # groups started and not yet complete
        self._complete: dict = {}                  # group -> its samples, in completion order

    def collect(self) -> tuple[TrajectoryBatch, dict[str, float], dict[str, float]]:
        """Play until `groups_per_batch` groups are complete -> (batch, rollout stats, engine stats).

        Every waiting request goes to the engine (`submit`) as soon as its game can play it; each
        `poll` hands back what finished and the env steps those games. Phase barrier (`stream`
        off): a poll waits for every request in flight, so each round is one phase of every live
        game. Streaming: a poll returns as soon as any request finished, so a game moves on
        without waiting for the slowest completion of the round. Either way nothing is in flight
        when this returns (adapter updates happen between batches)."""
        t0 = time.perf_counter()
        while len(self._live) + len(self._complete) < self.groups_per_batch + self.oversample:
            self.env.start_group(self.next_group)
            self._live.add(self.next_group)
            self.next_group += 1
        poll_s: list[float] = []      # one engine poll (barrier: one phase of every live game)
        request_s: list[float] = []   # per request: submit -> completion handed back
        group_s: dict = {}            # group key -> seconds until its samples were complete
        in_flight: dict = {}          # ticket -> (env key, submit time)
        out_tokens, requests = 0, 0
        while len(self._complete) < self.groups_per_batch or in_flight:
            if len(self._complete) < self.groups_per_batch:  # past it: only drain what is in flight
                keys = {k for k, _ in in_flight.values()}
                waiting = [(k, r) for k, r in self.env.requests() if k not in keys]
                if waiting:
                    now = time.perf_counter()
                    for ticket, (k, _) in zip(self.engine.submit([r for _, r in waiting]), waiting):
                        in_flight[ticket] = (k, now)
                    requests += len(waiting)
            if not in_flight:
                finished = self.env.pop_finished()
                if not finished:
                    raise RuntimeError(f"env has no requests and {len(self._live)} unfinished groups")
            else:
                t = time.perf_counter()
                done = self.engine.poll(wait_all=not self.stream)
                now = time.perf_counter()
                poll_s.append(now - t)
                answers = {}
                for ticket, completion in done:
                    key, t_submit = in_flight.pop(ticket)
                    answers[key] = completion
                    request_s.append(now - t_submit)
                    out_tokens += len(completion.token_ids)
                self.env.step(answers)
                finished = self.env.pop_finished()
            now = time.perf_counter() - t0
            for s in finished:
                group_s.setdefault(s.group_key, now)
                self._complete.setdefault(group_of(s), []).append(s)
                self._live.discard(group_of(s))
        gen_time = sum(poll_s)  # time blocked in the engine (host work overlaps it when streaming)
        taken = list(self._complete)[: self.groups_per_batch]
        samples = [s for g in taken for s in self._complete.pop(g)]
        advantages = group_advantages(samples)
        batch = build_batch(samples, advantages)
        elapsed = time.perf_counter() - t0
        stats = {
            "reward": float(batch.rewards.mean()) if samples else 0.0,
            "samples": float(len(samples)),
            "polls": float(len(poll_s)),
            "latency_s": elapsed,
            "games_per_s": self.groups_per_batch * getattr(self.env, "group_size", 1) / max(elapsed, 1e-9),
            **percentiles(poll_s, "poll_latency_s"),
            **percentiles(request_s, "request_latency_s"),
            **percentiles(list(group_s.values()), "group_latency_s"),
            "groups_carried_over": float(len(self._live) + len(self._complete)),
            **{k: float(v) for k, v in self.env.metrics().items()},
        }
        # Streamed, the engine (its own process) keeps working while this thread steps the env: its
        # tokens/s are over the whole collect, and generate_fraction is the share spent blocked in poll.
        engine_stats = {
            "out_tokens": float(out_tokens),
            "out_tokens_per_s": out_tokens / max(elapsed if self.stream else gen_time, 1e-9),
            "requests_per_call": requests / max(len(poll_s), 1),  # streamed: submissions per poll
            "generate_fraction": gen_time / max(elapsed, 1e-9),
            **(self.engine.stats() if hasattr(self.engine, "stats") else {}),
        }
        return batch, stats, engine_stats
