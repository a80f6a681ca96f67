"""Held-out evaluation on the inference rank, between training batches (`eval` config section).

Inference rank 0 evaluates alone: the env's `evaluate` scores its whole eval set with the engine's
current adapter, while the other inference ranks go on sampling (the learners wait for rank 0's
shard of that batch, so a step is longer by one evaluation). Splitting the eval set over the ranks
would need one more exchange per evaluation for a saving that only matters with large eval sets.

It runs when the engine has taken version 0, every `eval.every`-th version, and, with `eval.at_end`,
the final one. Results go to TensorBoard under `eval/` (the step is the adapter version) and, at the
end, to learner rank 0, which puts them into summary.json (`history`).
"""
from __future__ import annotations

import os
import time

from colocate.config import Config
from colocate.engine.base import Engine
from colocate.envs.base import Env
from colocate.metrics import MetricsWriter


class Evaluator:
    def __init__(self, cfg: Config, env: Env, engine: Engine, writer: MetricsWriter, *, enabled: bool):
        self.cfg, self.env, self.engine, self.writer, self.enabled = cfg, env, engine, writer, enabled
        self.history: list[dict] = []  # [{"version": v, "eval_s": s, **metrics}]

    def due(self, version: int) -> bool:
        every = self.cfg.eval.every
        done = {h["version"] for h in self.history}
        return self.enabled and every > 0 and version % every == 0 and version not in done

    def run(self) -> dict[str, float]:
        """Evaluate the engine's current adapter; log and keep the result."""
        version = self.engine.version
        t0 = time.perf_counter()
        metrics = self.env.evaluate(self.engine, self.cfg.eval, os.path.join(self.cfg.metrics.run_dir, "eval"))
        metrics = {k: float(v) for k, v in metrics.items()}
        if not metrics:
            return metrics
        eval_s = time.perf_counter() - t0
        self.history.append({"version": version, "eval_s": eval_s, **metrics})
        self.writer.scalars("eval", {**metrics, "eval_s": eval_s}, version)
        shown = " ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        self.writer.print(f"eval at version {version}: {shown} ({eval_s:.1f}s)")
        return metrics

    def between_batches(self) -> None:
        if self.due(self.engine.version):
            self.run()

    def at_end(self, stopped: bool) -> None:
        """The final version (not after a stop: the run ends as fast as it can)."""
        done = {h["version"] for h in self.history}
        if self.enabled and self.cfg.eval.at_end and not stopped and self.engine.version not in done:
            self.run()
