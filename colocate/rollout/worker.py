"""Rollout worker: drive an Env with an Engine until enough groups finish, then build one batch.

All requests of all live games go to the engine in one `generate` call per round (continuous
batching across games), never one call per game. Advantages are normalized per group key.
"""
from __future__ import annotations

import time

from colocate.data import Sample, TrajectoryBatch, build_batch, group_advantages
from colocate.metrics import percentiles


class RolloutWorker:
    def __init__(self, env, engine, *, groups_per_batch: int, first_group_id: int = 0):
        self.env = env
        self.engine = engine
        self.groups_per_batch = groups_per_batch
        self.next_group = first_group_id

    def collect(self) -> tuple[TrajectoryBatch, dict[str, float], dict[str, float]]:
        """Play `groups_per_batch` groups to the end -> (batch, rollout stats, engine stats)."""
        t0 = time.perf_counter()
        for _ in range(self.groups_per_batch):
            self.env.start_group(self.next_group)
            self.next_group += 1
        samples: list[Sample] = []
        round_s: list[float] = []     # one engine call = one phase of every live game
        group_s: dict = {}            # group key -> seconds until its samples were complete
        out_tokens, requests = 0, 0
        while True:
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
            samples.extend(finished)
            if not keyed:
                break
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
            **{k: float(v) for k, v in self.env.metrics().items()},
        }
        engine_stats = {
            "out_tokens_per_s": out_tokens / max(gen_time, 1e-9),
            "requests_per_call": requests / max(len(round_s), 1),
            "generate_fraction": gen_time / max(elapsed, 1e-9),
            **(self.engine.stats() if hasattr(self.engine, "stats") else {}),
        }
        return batch, stats, engine_stats
