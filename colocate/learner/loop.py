"""The learner role loop: receive trajectory shards, train, send the adapter, checkpoint.

Per step s: receive one shard from every inference rank (with the engines' canary scores of the
version that sampled it) -> `Learner.train_step`, whose first forward carries the canary's probe:
the learner's reference of version s, against which the engines' scores are then checked
(`colocate.canary`) -> every learner joins the adapter gather -> the adapter sender puts version
s + 1 on the wire with run-control flags -> (on schedule, at the end or on a stop) a checkpoint.
With LoRA dropout the training forward is not the reference's: the probe then gets a forward of its
own after the send (`record_canary`). A non-finite loss skips
the update (the Learner does that) and `metrics.max_nonfinite_steps` in a row end the run; a
canary mismatch stops it after the step (`metrics.stop_on_mismatch`). This module never
imports an engine: how adapters reach the engines is the `AdapterSender` the composition root
passes in.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import yaml
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.profiler import record_function

from colocate.canary import CanaryCheck, CanaryResult, compute_dtype, fp8_parts
from colocate.channel import AdapterSender
from colocate.config import Config, eval_enabled, sampling_lag, to_dict
from colocate.data import TrajectoryBatch
from colocate.jsonfile import write_atomic
from colocate.learner.summary import RunFigures, SteadyState, learner_memory, write_summary
from colocate.lifecycle import NO_FAULTS, Faults, StopSignal
from colocate.metrics import CollapseMonitor, MetricsWriter, make_profiler, role_monitors
from colocate.models import canonical_name
from colocate.startup import (Timeline, compile_line, compile_record, first_step_line, mark, merge, process_timeline,
                              receive_marks, send_marks)
from colocate.topology import Topology, gpu_index
from colocate.wire import RunFlags, recv_batch, recv_json, unflatten_lora


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


@dataclass(frozen=True)
class TimelineRow:
    """One learner step's times (unix seconds) and sync costs; `summary.json`'s `timeline` holds one
    per step, as a JSON object, and the e2e benchmark takes its steady-state figures from them."""
    wait_start: float   # the step began waiting for its shards
    train_start: float  # they arrived
    train_end: float    # the train step ended
    step_end: float     # the adapter was sent and the step logged
    policy_lag: float   # mean policy lag of the trained sequences
    gather_s: float     # the adapter gather
    send_s: float       # the adapter send
    canary_s: float = 0.0  # the learner's canary probe (`record_canary`); 0: the version was not scored
    canary_device_ms: float = 0.0  # an earlier probe's device time, read at this step (`DeviceTimer`); 0: none
    canary_rode: bool = False  # the probe rode this step's first forward (the version it started from): its
    # cost is inside the train time, no time of its own

    def to_json(self) -> dict:
        return asdict(self)


class LearnerRank:
    """One learner rank's state across steps: the `Learner`, its adapter sender, history and timers."""

    def __init__(self, cfg: Config, topo: Topology, learner, sender: AdapterSender, stop: StopSignal,
                 probe: list[int], start: int = 0):
        self.cfg, self.topo, self.learner, self.sender, self.stop = cfg, topo, learner, sender, stop
        self.probe = probe  # the canary's token ids (`canary.probe_ids`), the engines score the same
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
        shape = learner.model.config
        self.canary = CanaryCheck(compute_dtype(cfg.model.dtype, topo.device.type == "cuda"),
                                  reduction=max(shape.hidden_size, shape.intermediate_size),
                                  num_layers=shape.num_hidden_layers, every=cfg.sync.canary_every,
                                  fp8_parts=fp8_parts(cfg.engine.quantization, cfg.engine.kv_cache_dtype))
        self.canary_gap: float | None = None  # this step's canary gap (step line)
        self.scores: list = []  # the engines' canary scores received this step (`check_canary`)
        self.probe_timer = DeviceTimer(topo.device)  # the probe's device time, read a step later
        self.canary_device_ms = 0.0  # the device ms read this step (the timeline's canary_device_ms)
        self.mismatch = False  # this step's canary failed
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
        the engines' canary scores that came with them are kept for `check_canary`, after the step's
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
        self.scores = [s.canary for s in received if s.canary is not None]  # checked after the step's forward
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

    def check_canary(self, scores: list, step: int) -> None:
        """The engines' probe log-probs against the learner's of the same version (`colocate.canary`)."""
        result = self.canary.check(scores)
        if result is not None and self.topo.num_learners > 1:
            result = self.one_verdict(result)
        self.canary_gap, self.mismatch = (result.gap, result.failed) if result is not None else (None, False)
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

    def record_canary(self, step: int | None) -> float:
        """With LoRA dropout (`Learner.rides_probe` false; else the step's first forward scored it):
        the learner's probe log-probs of its current version, when that version is scored (every
        learner: one forward, queued, never waited for here), and `sync/canary_learner_ms`, the
        learner thread's own time on it, at `step`, the step that made the version (trackers take
        steps in order: W&B drops older ones); None (the version a run starts with): not logged.
        On a GPU also an earlier probe's device time, once its kernels are done
        (`sync/canary_learner_device_ms` at this step, the timeline's `canary_device_ms`).
        -> the host time in seconds (the timeline's `canary_s`), 0 when the version is not scored."""
        done = self.probe_timer.done_ms()  # an earlier probe's kernels, long done on the GPU
        self.canary_device_ms = done or 0.0
        if done is not None and step is not None:
            self.writer.scalars("sync", {"canary_learner_device_ms": done}, step)
        if self.learner.rides_probe or not self.canary.due(self.learner.version):  # the step's forward scored it
            return 0.0
        t0 = time.perf_counter()
        self.canary.record(self.learner.version, *self.probe_timer.around(lambda: self.learner.score_probe(self.probe)))
        took = time.perf_counter() - t0
        if step is not None:
            self.writer.scalars("sync", {"canary_learner_ms": took * 1e3}, step)
        return took

    def train(self, batch: TrajectoryBatch, step: int, waits: dict) -> dict[str, float]:
        """`Learner.train_step` -> its stats (+ MFU); the train start and end go into `waits`."""
        self.faults.on_batch(step, batch)
        lags = (self.learner.version - batch.versions.long()).float()  # [B] policy lag of each sequence
        self.writer.histogram("learner/policy_lag", lags, step)
        t_train, waits["u_train"] = time.perf_counter(), time.time()
        due = self.canary.due(self.learner.version)
        with record_function("learner/train_step"):
            stats = self.learner.train_step(batch, self.probe if due else None)
        self.busy_s += time.perf_counter() - t_train
        if self.learner.probe_scored is not None:  # the version the step started from
            self.canary.record(*self.learner.probe_scored)
        self.check_canary(self.scores, step)
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
            errors = int(stats["reward_errors"])  # samples no reward function scored: say so on the line
            self.writer.print(f"step {step + 1}/{self.cfg.learner.num_steps} reward {stats['reward']:.3f} "
                              + (f"({errors} reward errors) " if errors else "") +
                              f"loss {stats['loss']:+.4f} kl {stats['kl']:.4f} clip {stats['clip_fraction']:.3f} "
                              f"ent {stats['entropy']:.3f} gnorm {stats['grad_norm']:.3f} "
                              f"ratio {stats['ratio']:.3f}/{stats['ratio_max']:.2f} zadv {stats['zero_adv_fraction']:.2f} "
                              f"lag {stats['policy_lag_mean']:.1f} tok/s {stats['tokens_per_s']:.0f} "
                              f"step {stats['step_s']:.2f}s wait {wait_s:.2f}s{busy_text(waits)}{self.canary_text()}"
                              f"{self.eta.text(step)}")
        self.timeline.append(TimelineRow(waits["u0"], waits["u_train"], waits["u_trained"], time.time(),
                                         stats["policy_lag_mean"], gather_s, sync_s, canary_s, self.canary_device_ms,
                                         self.learner.probe_scored is not None))
        self.writer.flush()

    def canary_text(self) -> str:
        return "" if self.canary_gap is None else f" canary {self.canary_gap:.1e}"

    def drain(self, step: int) -> None:
        """After a stop at `step`: batches step+1 .. step+lag were already sampled and sent; receive
        and drop them, so no inference rank is left blocked in a send."""
        for _ in range(min(step + 1 + sampling_lag(self.cfg), self.cfg.learner.num_steps) - (step + 1)):
            for src in self.topo.inference_ranks:
                recv_batch(src, self.topo.transport_group)


def busy_text(waits: dict) -> str:
    """The step line's inference busy share: the inference ranks' time collecting their last batch
    over the interval it took them (mean over ranks), beside the learner's `wait`."""
    busy = waits.get("inference_busy")
    return "" if busy is None else f" inf {busy:.0%} busy"


def stop_reasons(cfg: Config, rank: LearnerRank) -> list[str]:
    """The stop policies this step's flags trigger, the one the lines name first: "mismatch" (the
    canary, metrics.stop_on_mismatch), "collapse" (the reward, metrics.stop_on_collapse)."""
    flags = {"mismatch": rank.mismatch, "collapse": rank.monitor.collapsed}
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
    canary_s = rank.record_canary(step)  # after the send: the engines take the version without waiting for the probe
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


def note_last_good(cfg: Config, writer: MetricsWriter, good_step: int, step: int, why: str) -> None:
    """<run_dir>/checkpoints/last_good.json: the newest checkpoint at or before `good_step` (a
    collapse: the monitor's last step before the drop; a canary mismatch: the step before the
    engine's samples were trained on), and one line saying which."""
    from colocate.checkpoint import checkpoint_root, checkpoints
    root = checkpoint_root(cfg.metrics.run_dir)
    good = [p for p in checkpoints(root) if checkpoint_step(p) <= good_step]  # newest first
    path = good[0] if good else None
    write_atomic(os.path.join(root, "last_good.json"),
                 {"path": path, "step": checkpoint_step(path) if path else None, f"{why}_step": step})
    writer.print(f"{why} at step {step}: last good checkpoint {path or 'none (set checkpoint.every)'}")


def checkpoint_step(path: str) -> int:
    return int(os.path.basename(path).rpartition("-")[2])


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
    rank.record_canary(None)  # the version the engines start with
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


class StepClock:
    """The ETA on a step line: the mean time of the steps since the first one this process logged
    (the first includes warm-up), times the steps left."""

    def __init__(self, num_steps: int):
        self.num_steps, self.first = num_steps, None

    def text(self, step: int) -> str:
        now = time.perf_counter()
        if self.first is None:
            self.first = (step, now)
        done, left = step - self.first[0], self.num_steps - 1 - step
        if done <= 0 or left <= 0:
            return ""
        eta = (now - self.first[1]) / done * left
        return f" eta {int(eta // 3600)}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}"


def restore_learner(learner, resume: dict) -> int:
    """Adapter, optimizer and RNG from a checkpoint; returns the step to continue from."""
    from colocate.checkpoint import check_adapter_matches, unflatten_optimizer
    live = {canonical_name(n): p for n, p in learner.model.named_parameters() if "lora_" in n}
    check_adapter_matches(resume["adapter"], live, resume["path"])
    with torch.no_grad():
        for name, param in live.items():
            src = resume["adapter"][name]
            if isinstance(param, DTensor):  # an FSDP2 shard
                src = distribute_tensor(src.to(param.dtype), param.device_mesh, param.placements)
            param.copy_(src)
    params = [p for group in learner.optimizer.param_groups for p in group["params"]]
    learner.optimizer.load_state_dict(unflatten_optimizer(resume["optimizer_tensors"], resume["optimizer_meta"], params))
    torch.set_rng_state(resume["rng"]["torch_cpu"])
    learner.version = resume["trainer_state"]["version"]
    return resume["trainer_state"]["step"]


def write_checkpoint(cfg: Config, topo: Topology, learner, adapter: dict, history: dict, step: int,
                     faults: Faults, protect_step: int | None = None) -> None:
    """Every learner joins the optimizer-state gather; learner rank 0 collects the inference ranks'
    states and writes the checkpoint atomically (with the base model's identity in its manifest)."""
    from colocate.checkpoint import (CheckpointState, checkpoint_root, flatten_optimizer, peft_config_dict,
                                     save_checkpoint)
    # Gathering DTensor optimizer state (FSDP2) is a collective: every learner flattens it.
    optimizer_state = flatten_optimizer(learner.optimizer.state_dict())
    if topo.rank != topo.sync_src:
        return
    inference = {str(r): recv_json(r, topo.transport_group) for r in topo.inference_ranks}
    trainer_state = {"step": step, "version": learner.version, "history": history, "inference": inference}
    state = CheckpointState(adapter, peft_config_dict(learner.model), optimizer_state,
                            {"torch_cpu": torch.get_rng_state()}, trainer_state,
                            yaml.safe_dump(to_dict(cfg), sort_keys=False), base=learner.base)
    path = save_checkpoint(checkpoint_root(cfg.metrics.run_dir), step, state, keep=cfg.checkpoint.keep,
                           faults=faults, protect_step=protect_step)
    print(f"[learner] checkpoint written: {path}", flush=True)
