"""Metrics: TensorBoard scalars per role, a progress line per role, the run summary.

Names are namespaced `rollout/…`, `engine/…`, `learner/…`, `sync/…`, `system/…`. Only a role's
first rank writes (`MetricsWriter(enabled=...)`), so a role logs once whatever its size.
"""
from __future__ import annotations

import json
import os
import sys
import time


class MetricsWriter:
    def __init__(self, run_dir: str, role: str, *, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.role = role
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tb", role))

    def scalars(self, namespace: str, values: dict[str, float], step: int) -> None:
        if self._tb is None:
            return
        for key, value in values.items():
            self._tb.add_scalar(f"{namespace}/{key}", float(value), step)

    def print(self, message: str) -> None:
        if self.enabled:
            print(f"[{time.strftime('%H:%M:%S')} {self.role}] {message}", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


def write_json_atomic(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
