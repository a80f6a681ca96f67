"""The learner role loop: receive trajectory shards, train, send the adapter, checkpoint.

Per step s: receive one shard from every inference rank (with the engines' canary scores of the
version that sampled it) -> `Learner.train_step`, whose first forward carries the canary's probe:
the learner's reference of version s, against which the engines' scores are then checked
(`colocate.canary`) -> every learner joins the adapter gather -> the adapter sender puts version
s + 1 on the wire with run-control flags -> (on schedule, at the end or on a stop) a checkpoint.
With LoRA dropout the training forward is not the reference's: the probe then gets a forward of its
own after the send (`RankCanary.score_apart`; the canary's bookkeeping is `rank_canary.py`). A
non-finite loss skips the update (the Learner does that) and `metrics.max_nonfinite_steps` in a row
end the run; a canary mismatch stops it after the step (`metrics.stop_on_mismatch`). The step line
and the timeline row are `step_report.py`'s, checkpoints `checkpointing.py`'s. This module never
imports an engine: how adapters reach the engines is the `AdapterSender` the composition root
passes in.
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from colocate.channel import AdapterSender
from colocate.config import Config, eval_enabled, sampling_lag
from colocate.data import TrajectoryBatch
from colocate.jsonfile import write_atomic
from colocate.learner.checkpointing import note_last_good, restore_learner, write_checkpoint
from colocate.learner.rank_canary import RankCanary
from colocate.learner.step_report import StepClock, TimelineRow, step_line
from colocate.learner.summary import RunFigures, SteadyState, learner_memory, write_summary
from colocate.lifecycle import NO_FAULTS, Faults, StopSignal
from colocate.metrics import CollapseMonitor, MetricsWriter, make_profiler, role_monitors
from colocate.startup import (Timeline, compile_line, compile_record, first_step_line, mark, merge, process_timeline,
                              receive_marks, send_marks)
from colocate.topology import Topology, gpu_index
from colocate.wire import RunFlags, recv_batch, recv_json, unflatten_lora


class LearnerRank:
    """One learner rank's state across steps: the `Learner`, its adapter sender, history and timers."""

    def __init__(self, cfg: Config, topo: Topology, learner, sender: AdapterSender, stop: StopSignal,
                 probe: list[int], start: int = 0):
        self.cfg, self.topo, self.learner, self.sender, self.stop = cfg, topo, learner, sender, stop
        self.writer = MetricsWriter(cfg.metrics.run_dir, "learner", enabled=topo.role_rank == 0, first_step=start,
                                    tensorboard=cfg.metrics.tensorboard and "tensorboard" in cfg.metrics.loggers)
        if topo.role_rank == 0:  # W&B / MLflow / trackio: the learner's scalars, once per job
            from colocate.trackers import open_trackers
            self.writer.trackers = open_trackers(cfg)
        self.faults: Faults = NO_FAULTS  # run_learner sets the composition root's
        self.eta = StepClock(cfg.learner.num_steps)
        self.history: dict[str, list[float]] = {"reward": [], "loss": [], "reward_errors": []}
        self.monitor = CollapseMonitor(cfg.metrics)  # same global stats on every learner: same verdicts
        self.collapsed_at: int | None = None  # the step whose reward_drop alert stopped the run
        self.canary = RankCanary(cfg, topo, learner, probe, self.writer)  # `probe`: the canary's token ids
        self.mismatch_at: int | None = None  # the step whose canary mismatch stopped the run
        self.nonfinite_run, self.busy_s, self.dropped = 0, 0.0, 0.0
        self.timeline: list[TimelineRow] = []
        self.first_step = start
        self.startup_marks: dict[int, Timeline] = {}  # (learner rank 0) every other rank's start-up marks
        self.startup: dict = {}  # (learner rank 0) startup.json's record, once the first step ended
        self.steady_from: tuple[float, float] | None = None  # (time, busy_s) at the end of the first step
        self.block_params = sum(p.numel() for n, p in learner.model.named_parameters()
                                if ".layers." in n and "lora_" not in n)

    def receive(self, step: int) -> tuple[TrajectoryBatch, bool, dict]:
        """One shard from every inference rank -> (batch, a stop was requested there, wait times);
        the engines' canary scores that came with them are kept for `RankCanary.verify`, after the step's
        forward (which scores the learner's own reference of the version the step starts from)."""
        t0, u0 = time.perf_counter(), time.time()
        received = [recv_batch(src, self.topo.transport_group) for src in self.topo.inference_ranks]
        # the last adapter's sends to the engines count as waiting, not training
        send_wait_s = self.sender.wait_sent()
        if step == self.first_step:
            self.first_shards()
        busy = [s.busy for s in received if s.busy is not None]
        waits = {"t0": t0, "u0": u0, "wait_s": time.perf_counter() - t0, "send_wait_s": send_wait_s,
                 "inference_busy": sum(busy) / len(busy) if busy else None}
        self.canary.scores = [s.canary for s in received if s.canary is not None]  # checked after the forward
        return TrajectoryBatch.concat([s.batch for s in received]), any(s.flags & RunFlags.STOP for s in received), waits

    def first_shards(self) -> None:
        """The first shards arrived: the mark, and (learner rank 0) the inference ranks' start-up
        marks, which they sent right after those shards (before this rank's first adapter send,
        which waits on them)."""
        mark("first_batch")
        if self.topo.rank == self.topo.sync_src:
            self.startup_marks.update(receive_marks(self.topo, self.topo.inference_ranks))

    def end_first_step(self) -> None:
        """The start-up's end: every learner's marks reach learner rank 0, which writes
        `startup.json` and prints where the seconds went (`colocate.startup`)."""
        mark("first_step_end")
        self.steady_from = (time.perf_counter(), self.busy_s)
        if self.topo.rank != self.topo.sync_src:
            send_marks(self.topo)
            return
        self.startup_marks.update(receive_marks(self.topo, self.topo.learner_ranks[1:]))
        timelines = {r: (self.topo.roles[r], t) for r, t in self.startup_marks.items()}
        timelines[self.topo.rank] = ("learner", process_timeline())
        self.startup = merge(timelines)
        compiled = compile_record()  # this rank's; every learner compiles the same graphs
        if compiled:
            self.startup["learner_compile"] = compiled
        write_atomic(os.path.join(self.cfg.metrics.run_dir, "startup.json"), self.startup)
        self.writer.print(first_step_line(self.startup))
        if compiled:
            self.writer.print(compile_line(compiled))

    def train(self, batch: TrajectoryBatch, step: int, waits: dict) -> dict[str, float]:
        """`Learner.train_step` -> its stats (+ MFU); the train start and end go into `waits`."""
        self.faults.on_batch(step, batch)
        lags = (self.learner.version - batch.versions.long()).float()  # [B] policy lag of each sequence
        self.writer.histogram("learner/policy_lag", lags, step)
        t_train, waits["u_train"] = time.perf_counter(), time.time()
        due = self.canary.check.due(self.learner.version)
        with record_function("learner/train_step"):
            stats = self.learner.train_step(batch, self.canary.probe if due else None)
        self.busy_s += time.perf_counter() - t_train
        if self.learner.probe_scored is not None:  # the version the step started from
            self.canary.check.record(*self.learner.probe_scored)
        self.canary.verify(step)
        waits["u_trained"] = time.time()
        self.dropped += stats["dropped_stale"]
        # Model FLOPs utilization of the decoder-block GEMMs (forward + input-gradient: 4 x params x
        # tokens; frozen base, no weight gradients), over the configured per-device peak. The trainer
        # benchmark adds attention and the lm_head (profiles/README.md).
        stats["mfu"] = 4 * self.block_params * stats["model_tokens"] / max(
            stats["step_s"] * self.topo.num_learners * self.cfg.metrics.peak_tflops * 1e12, 1e-9)
        self.check_finite(stats["loss"], step)
        for name, message in self.monitor.update(step + 1, stats["reward"], stats["entropy"], stats["grad_norm_max"]):
            self.writer.alert(name, message, step)
        for key in self.history:  # reward, loss, reward_errors
            self.history[key].append(stats[key])
        return stats

    def check_finite(self, loss: float, step: int) -> None:
        """The learner skipped a non-finite update; `metrics.max_nonfinite_steps` in a row are fatal."""
        if math.isfinite(loss):
            self.nonfinite_run = 0
            return
        self.nonfinite_run += 1
        limit = self.cfg.metrics.max_nonfinite_steps
        self.writer.alert("nonfinite_loss", f"loss {loss} at step {step + 1}: update skipped "
                          f"({self.nonfinite_run} in a row, limit {limit})", step)
        if self.nonfinite_run >= limit:
            raise RuntimeError(f"{self.nonfinite_run} non-finite losses in a row (metrics.max_nonfinite_steps); "
                               f"last at step {step + 1}: lower learner.lr or check the data")

    def agree_to_stop(self, requested_elsewhere: bool) -> bool:
        """Stop when any rank saw a signal; every learner must agree (one all-reduce)."""
        stop_now = torch.tensor([float(self.stop.requested or requested_elsewhere)], device=self.topo.device)
        if self.topo.num_learners > 1:
            dist.all_reduce(stop_now, op=dist.ReduceOp.MAX, group=self.topo.learner_group)
        return bool(stop_now.item())

    def publish(self, flags: RunFlags) -> tuple[dict[str, torch.Tensor], float, float]:
        """Every learner joins the gather; the sender puts the new version on the wire (enqueued:
        later kernels on this stream wait for it) -> (adapter views, gather s, send s)."""
        t_gather = time.perf_counter()
        flat = self.learner.lora_flat()  # [numel] full adapter from the shards
        gather_s = time.perf_counter() - t_gather
        sync_s = self.sender.send(flat, self.learner.version, flags)
        return unflatten_lora(flat, self.learner.lora_spec), gather_s, sync_s

    def log(self, step: int, stats: dict, waits: dict, gather_s: float, sync_s: float, canary_s: float) -> None:
        last = step == self.cfg.learner.num_steps - 1
        wait_s = waits["wait_s"]
        self.writer.scalars("learner", {**stats, "wait_s": wait_s,
                                        "idle_fraction": wait_s / max(time.perf_counter() - waits["t0"], 1e-9)}, step)
        self.writer.scalars("rollout", {"reward": stats["reward"], "policy_lag": stats["policy_lag_mean"]}, step)
        self.writer.scalars("sync", {"broadcast_ms": sync_s * 1e3, "gather_ms": gather_s * 1e3,
                                     "send_wait_ms": waits["send_wait_s"] * 1e3}, step)
        if step % self.cfg.metrics.log_every == 0 or last:
            self.writer.print(step_line(step, self.cfg.learner.num_steps, stats, waits,
                                        self.canary.text() + self.eta.text(step)))
        self.timeline.append(TimelineRow(waits["u0"], waits["u_train"], waits["u_trained"], time.time(),
                                         stats["policy_lag_mean"], gather_s, sync_s, canary_s, self.canary.device_ms,
                                         self.learner.probe_scored is not None))
        self.writer.flush()

    def drain(self, step: int) -> None:
        """After a stop at `step`: batches step+1 .. step+lag were already sampled and sent; receive
        and drop them, so no inference rank is left blocked in a send."""
        for _ in range(min(step + 1 + sampling_lag(self.cfg), self.cfg.learner.num_steps) - (step + 1)):
            for src in self.topo.inference_ranks:
                recv_batch(src, self.topo.transport_group)


def stop_reasons(cfg: Config, rank: LearnerRank) -> list[str]:
    """The stop policies this step's flags trigger, the one the lines name first: "mismatch" (the
    canary, metrics.stop_on_mismatch), "collapse" (the reward, metrics.stop_on_collapse)."""
    flags = {"mismatch": rank.canary.mismatch, "collapse": rank.monitor.collapsed}
    return [name for name, raised in flags.items() if raised and getattr(cfg.metrics, f"stop_on_{name}")]


def stop_line(cfg: Config, reasons: list[str], signum: int | None, step: int, checkpointed: bool) -> str:
    """What a stop after `step` kept: its checkpoint, or (checkpoints off) only the run's adapter."""
    import signal
    why = f"metrics.stop_on_{reasons[0]}" if reasons else signal.Signals(signum).name if signum else "signal"
    kept = (f"checkpoint at step {step}" if checkpointed else
            f"no checkpoint (checkpoint.enabled is false), the adapter of step {step} is in "
            f"{os.path.join(cfg.metrics.run_dir, 'adapter')}")
    return f"stop requested ({why}): {kept}; exiting"


def learner_step(rank: LearnerRank, step: int) -> bool:
    """One step of the protocol (module docstring) -> whether the run stops after it."""
    cfg = rank.cfg
    rank.faults.before_step(rank.topo.rank, step)
    batch, stop_elsewhere, waits = rank.receive(step)
    stats = rank.train(batch, step, waits)
    reasons = stop_reasons(cfg, rank)
    stop_requested = rank.agree_to_stop(stop_elsewhere or bool(reasons))
    if "collapse" in reasons:
        rank.collapsed_at = step + 1
    if "mismatch" in reasons:
        rank.mismatch_at = step + 1
    last = step == cfg.learner.num_steps - 1
    stopping = stop_requested and not last
    checkpointing = cfg.checkpoint.enabled and (
        stop_requested or last or (cfg.checkpoint.every > 0 and (step + 1) % cfg.checkpoint.every == 0))
    flags = (RunFlags.CHECKPOINT if checkpointing else RunFlags.NONE) | (RunFlags.STOP if stopping else RunFlags.NONE)
    adapter, gather_s, sync_s = rank.publish(flags)
    canary_s = rank.canary.score_apart(step)  # after the send: the engines take the version without waiting
    if checkpointing:
        # a mismatch: the checkpoints written before this step never trained on that engine's samples
        good_step = step if "mismatch" in reasons else rank.monitor.good_step if cfg.metrics.stop_on_collapse else None
        write_checkpoint(cfg, rank.topo, rank.learner, adapter, rank.history, step + 1, rank.faults,
                         protect_step=good_step)
        if reasons and rank.topo.rank == rank.topo.sync_src:
            note_last_good(cfg, rank.writer, good_step, step + 1, reasons[0])
    if (last or stopping) and rank.topo.role_rank == 0:  # the run's model, checkpoints on or off
        from colocate.checkpoint import peft_config_dict, save_adapter
        save_adapter(os.path.join(cfg.metrics.run_dir, "adapter"), adapter, peft_config_dict(rank.learner.model),
                     base=rank.learner.base, version=rank.learner.version)
    rank.log(step, stats, waits, gather_s, sync_s, canary_s)
    if stopping:
        rank.drain(step)
        rank.writer.print(stop_line(cfg, reasons, rank.stop.signum, step + 1, checkpointing))
    return stopping


def run_learner(cfg: Config, topo: Topology, learner, sender: AdapterSender, *, resume: dict | None,
                stop: StopSignal, probe: list[int], faults: Faults = NO_FAULTS) -> int | None:
    """The learner role: receive shards, train, hand the adapter to the inference ranks -> the step
    whose collapse or canary mismatch stopped the run (metrics.stop_on_collapse / stop_on_mismatch),
    or None."""
    start = resume["trainer_state"]["step"] if resume is not None else 0
    rank = LearnerRank(cfg, topo, learner, sender, stop, probe, start)
    rank.faults = faults
    if resume is not None:
        restore_learner(learner, resume)
        saved = resume["trainer_state"]["history"]  # older checkpoints kept no reward_errors: none counted
        rank.history = {k: list(saved.get(k, [0.0] * len(saved.get("reward", [])))) for k in rank.history}
    rank.canary.score_apart(None)  # the version the engines start with
    sender.ready()  # the engines are up (a failed start is named here, not at the first send)
    monitors = contextlib.ExitStack()  # daemon threads and a profiler window
    role = monitors.enter_context(role_monitors(cfg.metrics, rank.writer, gpu_index=gpu_index(topo),
                                                what="trajectory consumed"))
    profiler = make_profiler(cfg.metrics, "learner", topo.rank, enabled=topo.role_rank == 0)
    monitors.callback(profiler.stop)
    t_start = time.perf_counter()
    for step in range(start, cfg.learner.num_steps):
        stopping = learner_step(rank, step)
        if step == start:
            rank.end_first_step()
        role.watchdog.beat(step)
        role.check()
        if stopping:
            break
        profiler.step()
    sender.close()  # every engine asks for the last version; exiting first would strand it
    gpu_util = role.gpu_util()
    monitors.close()
    memory = learner_memory(topo)  # every learner joins the gather
    if topo.role_rank == 0:
        # inference rank 0's held-out evaluations (it sends them after its last one), then every
        # inference rank's busy share and memory peaks
        evaluation = recv_json(topo.inference_ranks[0], topo.transport_group) if eval_enabled(cfg) else {}
        reports = [recv_json(r, topo.transport_group) for r in topo.inference_ranks]
        steady = SteadyState.since(rank.steady_from, rank.busy_s, len(rank.history["reward"]) - start)
        write_summary(cfg, topo, rank, RunFigures(time.perf_counter() - t_start, start, gpu_util, memory,
                                                  evaluation, reports, steady))
        rank.writer.close()
    return rank.collapsed_at or rank.mismatch_at
