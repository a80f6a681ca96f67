"""Rollout worker: drive an Env with an Engine until enough groups finish, then build one batch.

All requests of all live games go to the engine in one `generate` call per round (continuous
batching across games), never one call per game. Advantages are normalized per group key.
"""
from __future__ import annotations

import time

from colocate.data import Sample, TrajectoryBatch, build_batch, group_advantages


class RolloutWorker:
    def __init__(self, env, engine, *, groups_per_batch: int, first_group_id: int = 0):
        self.env = env
        self.engine = engine
        self.groups_per_batch = groups_per_batch
        self.next_group = first_group_id

    def collect(self) -> tuple[TrajectoryBatch, dict[str, float]]:
        """Play `groups_per_batch` groups to the end -> (batch, stats)."""
        t0 = time.perf_counter()
        for _ in range(self.groups_per_batch):
            self.env.start_group(self.next_group)
            self.next_group += 1
        samples: list[Sample] = []
        rounds, gen_time, out_tokens = 0, 0.0, 0
        while True:
            keyed = self.env.requests()
            if not keyed:
                samples.extend(self.env.pop_finished())
                break
            t = time.perf_counter()
            completions = self.engine.generate([r for _, r in keyed])
            gen_time += time.perf_counter() - t
            out_tokens += sum(len(c.token_ids) for c in completions)
            self.env.step({key: c for (key, _), c in zip(keyed, completions)})
            samples.extend(self.env.pop_finished())
            rounds += 1
        advantages = group_advantages(samples)
        batch = build_batch(samples, advantages)
        elapsed = time.perf_counter() - t0
        stats = {
            "reward": float(batch.rewards.mean()) if samples else 0.0,
            "samples": float(len(samples)),
            "engine_rounds": float(rounds),
            "latency_s": elapsed,
            "generate_s": gen_time,
            "out_tokens_per_s": out_tokens / max(gen_time, 1e-9),
            **{k: float(v) for k, v in self.env.metrics().items()},
        }
        return batch, stats
