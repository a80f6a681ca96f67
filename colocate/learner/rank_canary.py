"""One learner rank's side of the sync canary across steps (`colocate.canary`): the learner's
references by version (`CanaryCheck`), the engines' scores checked against them after the step's
forward with one verdict over the learners (`RankCanary.verify`), the probe's forward of its own
when it cannot ride the step's (`RankCanary.score_apart`), and that forward's device time, read a
step later without waiting (`DeviceTimer`)."""
from __future__ import annotations

import math
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from colocate.canary import CanaryCheck, CanaryResult, compute_dtype, fp8_roundings
from colocate.config import Config
from colocate.metrics import MetricsWriter
from colocate.topology import Topology


class DeviceTimer:
    """A queued piece of GPU work's device time, read later without waiting: CUDA events around it
    (`around`), its milliseconds once its kernels are done (`done_ms`), else None. Off the GPU
    there is nothing to read (the work ran at once: its host time is its time)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: tuple | None = None

    def around(self, work):
        """`work()` between two events -> its result; an earlier reading not yet taken is dropped."""
        if not self.cuda:
            return work()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = work()
        end.record()
        self.pending = (start, end)
        return out

    def done_ms(self) -> float | None:
        if self.pending is None or not self.pending[1].query():
            return None
        start, end = self.pending
        self.pending = None
        return start.elapsed_time(end)


class RankCanary:
    """The canary's state on one learner rank: its references, this step's scores and verdict, the
    probe's device time."""

    def __init__(self, cfg: Config, topo: Topology, learner, probe: list[int], writer: MetricsWriter):
        self.cfg, self.topo, self.learner, self.writer = cfg, topo, learner, writer
        self.probe = probe  # the canary's token ids (`canary.probe_ids`), the engines score the same
        shape = learner.model.config
        self.check = CanaryCheck(compute_dtype(cfg.model.dtype, topo.device.type == "cuda"),
                                 reduction=max(shape.hidden_size, shape.intermediate_size),
                                 num_layers=shape.num_hidden_layers, every=cfg.sync.canary_every,
                                 fp8_roundings=fp8_roundings(cfg.engine.quantization, cfg.engine.lora_mode))
        self.gap: float | None = None  # this step's canary gap (step line)
        self.scores: list = []  # the engines' canary scores received this step (`verify`)
        self.timer = DeviceTimer(topo.device)  # the probe's device time, read a step later
        self.device_ms = 0.0  # the device ms read this step (the timeline's canary_device_ms)
        self.mismatch = False  # this step's canary failed

    def verify(self, step: int) -> None:
        """The engines' probe log-probs (`scores`) against the learner's of the same version."""
        result = self.check.check(self.scores)
        if result is not None and self.topo.num_learners > 1:
            result = self.one_verdict(result)
        self.gap, self.mismatch = (result.gap, result.failed) if result is not None else (None, False)
        if result is None:
            return
        self.writer.scalars("sync", {"canary_gap": result.gap, "canary_bound": result.bound}, step)
        if result.failed:
            stopping = "; stopping (metrics.stop_on_mismatch)" if self.cfg.metrics.stop_on_mismatch else ""
            self.writer.alert("canary_mismatch", f"adapter version {result.version}: the engine's log-probs of the "
                              f"canary probe differ from the learner's by {result.gap:.3g} nats on average (bound "
                              f"{result.bound:.3g}): it samples another policy than the one trained{stopping}", step)

    def one_verdict(self, result: CanaryResult) -> CanaryResult:
        """Each learner's reference rode its own first pass (other shapes: other roundings), so each
        rank's gap and bound differ a little: the largest gap and the smallest bound over the learners
        (a NaN gap counts as infinite), so every rank reaches the same verdict. Every learner checks
        in the same step: each receives every engine's score."""
        gap = result.gap if not math.isnan(result.gap) else math.inf
        both = torch.tensor([gap, -result.bound], dtype=torch.float64, device=self.topo.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.topo.learner_group)
        return replace(result, gap=float(both[0]), bound=-float(both[1]))

    def score_apart(self, step: int | None) -> float:
        """With LoRA dropout (`Learner.rides_probe` false; else the step's first forward scored it):
        the learner's probe log-probs of its current version, when that version is scored (every
        learner: one forward, queued, never waited for here), and `sync/canary_learner_ms`, the
        learner thread's own time on it, at `step`, the step that made the version (trackers take
        steps in order: W&B drops older ones); None (the version a run starts with): not logged.
        On a GPU also an earlier probe's device time, once its kernels are done
        (`sync/canary_learner_device_ms` at this step, the timeline's `canary_device_ms`).
        -> the host time in seconds (the timeline's `canary_s`), 0 when the version is not scored."""
        done = self.timer.done_ms()  # an earlier probe's kernels, long done on the GPU
        self.device_ms = done or 0.0
        if done is not None and step is not None:
            self.writer.scalars("sync", {"canary_learner_device_ms": done}, step)
        if self.learner.rides_probe or not self.check.due(self.learner.version):  # the step's forward scored it
            return 0.0
        t0 = time.perf_counter()
        self.check.record(self.learner.version, *self.timer.around(lambda: self.learner.score_probe(self.probe)))
        took = time.perf_counter() - t0
        if step is not None:
            self.writer.scalars("sync", {"canary_learner_ms": took * 1e3}, step)
        return took

    def text(self) -> str:
        """The step line's canary gap, when this step checked one."""
        return "" if self.gap is None else f" canary {self.gap:.1e}"
