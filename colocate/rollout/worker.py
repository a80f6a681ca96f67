"""Rollout worker: drive an Env with an Engine until enough groups finish, then build one batch.

All requests of all live games go to the engine in one `generate` call per round (continuous
batching across games), never one call per game. Advantages are normalized per group key.

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
    def __init__(self, env, engine, *, groups_per_batch: int, first_group_id: int = 0, oversample: int = 0):
        self.env = env
        self.engine = engine
        self.groups_per_batch = groups_per_batch
        self.oversample = oversample
        self.next_group = first_group_id
        self._live: set = set()                    # groups started and not yet complete
        self._complete: dict = {}                  # group -> its samples, in completion order

    def collect(self) -> tuple[TrajectoryBatch, dict[str, float], dict[str, float]]:
        """Play until `groups_per_batch` groups are complete -> (batch, rollout stats, engine stats)."""
        t0 = time.perf_counter()
        while len(self._live) + len(self._complete) < self.groups_per_batch + self.oversample:
            self.env.start_group(self.next_group)
            self._live.add(self.next_group)
            self.next_group += 1
        round_s: list[float] = []     # one engine call = one phase of every live game
        group_s: dict = {}            # group key -> seconds until its samples were complete
        out_tokens, requests = 0, 0
        while len(self._complete) < self.groups_per_batch:
            keyed = self.env.requests()
            if not keyed:
                finished = self.env.pop_finished()
            else:
                t = time.perf_counter()
                completions = self.engine.generate([r for _, r in keyed])
                round_s.append(time.perf_counter() - t)
                out_tokens += sum(len(c.token_ids) for c in completions)
                requests += len(keyed)
                self.env.step({key: c for (key, _), c in zip(keyed, completions)})
                finished = self.env.pop_finished()
            now = time.perf_counter() - t0
            for s in finished:
                group_s.setdefault(s.group_key, now)
                self._complete.setdefault(group_of(s), []).append(s)
                self._live.discard(group_of(s))
            if not keyed and not finished:
                raise RuntimeError(f"env has no requests and {len(self._live)} unfinished groups")
        taken = list(self._complete)[: self.groups_per_batch]
        samples = [s for g in taken for s in self._complete.pop(g)]
        advantages = group_advantages(samples)
        batch = build_batch(samples, advantages)
        elapsed = time.perf_counter() - t0
        gen_time = sum(round_s)
        stats = {
            "reward": float(batch.rewards.mean()) if samples else 0.0,
            "samples": float(len(samples)),
            "phases": float(len(round_s)),
            "latency_s": elapsed,
            "games_per_s": self.groups_per_batch * getattr(self.env, "group_size", 1) / max(elapsed, 1e-9),
            **percentiles(round_s, "phase_latency_s"),
            **percentiles(list(group_s.values()), "group_latency_s"),
            "groups_carried_over": float(len(self._live) + len(self._complete)),
            **{k: float(v) for k, v in self.env.metrics().items()},
        }
        engine_stats = {
            "out_tokens": float(out_tokens),
            "out_tokens_per_s": out_tokens / max(gen_time, 1e-9),
            "requests_per_call": requests / max(len(round_s), 1),
            "generate_fraction": gen_time / max(elapsed, 1e-9),
            **(self.engine.stats() if hasattr(self.engine, "stats") else {}),
        }
        return batch, stats, engine_stats
