"""The inference role loop: play games with the engine, ship trajectories, take new adapters.

Protocol (deterministic, so no rank waits on a message that will not come): for batch k = 0..S-1,
take adapters until the engine's version >= k - lag (`config.sampling_lag`), play this rank's share
of groups, send one shard of the batch to every learner (from a sender thread); at the end take
the remaining versions up to S. With `rollout.update=inflight` the worker returns with requests
still running, so the adapter taken before batch k lands between two engine steps while they run
(the engine's own process keeps decoding them meanwhile: vLLM). Adapter headers carry run control (`wire.RunFlags`): CHECKPOINT
(send this rank's sampler/env state to learner rank 0) and STOP (a signal was seen somewhere).
Before the first batch it samples with a new adapter version, the rank scores the sync canary's
probe with the engine (`Engine.score`, `colocate.canary`) and ships it with that batch's shards.
The engine, env and adapter receiver are built by the composition root (`train.py`); nothing here
knows which engine it drives.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from torch.profiler import record_function

from colocate import canary
from colocate.channel import AdapterReceiver
from colocate.config import Config, eval_enabled, sampling_lag
from colocate.data import shard_batch
from colocate.engine.base import Engine
from colocate.envs.base import Env
from colocate.lifecycle import StopSignal
from colocate.jsonfile import write_atomic
from colocate.metrics import EngineProfileWindow, MetricsWriter, Profilers, make_profiler, memory_peaks, role_monitors
from colocate.rollout.evaluation import Evaluator
from colocate.rollout.worker import RolloutSettings, RolloutWorker
from colocate.startup import mark, send_marks
from colocate.topology import Topology, gpu_index
from colocate.wire import ProbeScore, RunFlags, TrajectorySender, send_json

BATCH_STATS = ("polls", "samples", "latency_s", "poll_latency_s_p50", "poll_latency_s_p95", "request_latency_s_p50",
               "request_latency_s_p95", "group_latency_s_p95",
               "requests_per_call", "generate_fraction", "out_tokens", "out_tokens_per_s", "prefix_cache_hit_rate",
               "engine_errors", "prefill_tokens", "steps", "version_span", "tokens_after_update",
               "requests_in_flight")
"""Rollout and engine scalars kept per batch in `inference-rank<r>.json` (TensorBoard has them all)."""


class InferenceRank:
    """One inference rank's state across batches: its engine, env, worker and adapter receiver."""

    def __init__(self, cfg: Config, topo: Topology, engine: Engine, env: Env, receiver: AdapterReceiver,
                 stop: StopSignal, probe: list[int], start: int = 0):
        self.cfg, self.topo, self.engine, self.env, self.receiver, self.stop = cfg, topo, engine, env, receiver, stop
        self.probe = probe  # the canary's token ids (`canary.probe_ids`), the learner scores the same
        self.scored_version: int | None = None  # the last version the canary scored
        self.worker = RolloutWorker(env, engine, RolloutSettings.from_config(cfg, topo))
        self.writer = MetricsWriter(cfg.metrics.run_dir, "inference", enabled=topo.role_rank == 0, first_step=start,
                                    tensorboard=cfg.metrics.tensorboard and "tensorboard" in cfg.metrics.loggers)
        self.evaluator = Evaluator(cfg, env, engine, self.writer, enabled=topo.role_rank == 0)
        if start == 0:  # e.g. data/dropped/<reason> (env.bad_rows=skip); a resumed run logged them
            self.writer.scalars("data", env.data_stats(), 0)
        self.stopped = False  # a STOP flag arrived in an adapter header
        self.batches: list[dict] = []  # per batch: its version, where the rank waited, what the rollout did (e2e profile)
        # batch k -> this rank's resume state before it played batch k (checkpoints on, lag >= 1): the
        # checkpoint of version v arrives after batches v .. v + L - 1 were played, and a resume at
        # step v plays them again (they were sent, not trained). Kept until version k arrives.
        self.states_before: dict[int, dict] = {}
        self.first_version = start + 1  # the adapter of the learners' first step: the steady state starts there
        self.steady_from: float | None = None  # unix time it arrived

    def take_adapters_through(self, version: int) -> None:
        """Receive adapter updates until the engine samples with `version` (or a stop arrives)."""
        while self.engine.version < version and not self.stopped:
            update = self.receiver.receive()
            if update.version == self.first_version:
                self.steady_from = time.time()
            self.writer.scalars("sync", update.metrics, update.version)
            # the state before batch `version`: played already with lag >= 1, else the present one
            state = self.states_before.pop(update.version, None)
            if update.flags & RunFlags.CHECKPOINT:  # this rank's part of the checkpoint, at this version
                send_json(state or self.resume_state(), self.topo.sync_src, self.topo.transport_group)
            self.stopped = self.stopped or bool(update.flags & RunFlags.STOP)

    def start_canary(self) -> Callable[[], tuple[ProbeScore, float]] | None:
        """The engine's probe log-probs with the version it holds, once per version (every
        `sync.canary_every`), started now and read after the batch (`Engine.start_score`: vLLM runs the
        probe meanwhile): they travel with the batch's shards to the learners.
        `sync/canary_ms` is this rank's own time on it (queueing it, and what reading it waited); the
        call that reads it returns (the score, those ms)."""
        version = self.engine.version
        if not canary.due(version, self.cfg.sync.canary_every) or version == self.scored_version:
            return None
        self.scored_version = version
        t0 = time.perf_counter()
        read = self.engine.start_score(self.probe)
        queued_s = time.perf_counter() - t0

        def finish() -> tuple[ProbeScore, float]:
            t1 = time.perf_counter()
            logprobs = read()
            ms = (queued_s + time.perf_counter() - t1) * 1e3
            self.writer.scalars("sync", {"canary_ms": ms}, version)
            return ProbeScore(version, logprobs), ms
        return finish

    def resume_state(self) -> dict:
        """What this rank needs to resume sampling exactly (JSON)."""
        return {"rank": self.topo.rank, "next_group": self.worker.next_group, "env": self.env.state_dict(),
                "engine_rng": self.engine.rng_state()}

    def restore(self, resume: dict) -> None:
        """The adapter and this rank's sampler/env state as of the checkpoint (before its batch)."""
        trainer_state = resume["trainer_state"]
        self.engine.load_lora(trainer_state["version"], resume["adapter"])
        state = trainer_state["inference"].get(str(self.topo.rank))
        if state is not None:
            self.worker.next_group = state["next_group"]
            if state.get("env") is not None:
                self.env.load_state_dict(state["env"])
            if state.get("engine_rng") is not None:
                self.engine.set_rng_state(state["engine_rng"])

    def play_batch(self, k: int, sender: TrajectorySender, lag: int) -> tuple[dict, dict] | None:
        """Batch k: wait for its version and for old sends, collect, queue the shards -> (rollout
        stats, engine stats), or None when a stop arrived first."""
        t_wait = time.perf_counter()
        if self.cfg.checkpoint.enabled and lag > 0:
            self.states_before[k] = self.resume_state()
        self.take_adapters_through(k - lag)
        if self.stopped:
            return None
        probe = self.start_canary()
        self.evaluator.between_batches()
        t_version = time.perf_counter()
        # Sends of batch j complete once the learners start step j, which needs version j to have
        # been taken here; so only sends older than k - lag may be waited on (at most lag + 1
        # batches in flight: bounded memory, no deadlock).
        sender.wait_through(k - lag - 1)
        t_collect, u_collect = time.perf_counter(), time.time()
        with record_function("rollout/collect"):
            batch, stats, engine_stats = self.worker.collect()
        self.batches.append({"collect_start": u_collect, "collect_end": time.time(), "version": self.engine.version,
                             "wait_version_s": t_version - t_wait, "wait_send_s": t_collect - t_version,
                             "collect_s": time.perf_counter() - t_collect,
                             **{key: float(v) for key, v in {**stats, **engine_stats}.items() if key in BATCH_STATS}})
        probe_score = None
        if probe is not None:  # the batch's record keeps the probe's ms (the e2e benchmark's canary figures)
            probe_score, self.batches[-1]["canary_ms"] = probe()
        flags = RunFlags.STOP if self.stop.requested else RunFlags.NONE  # reaches the learners in the header
        # the step line's `inf`: not for this process's first batch, whose interval holds the start-up
        busy = self.batches[-1]["collect_s"] / max(time.perf_counter() - t_wait, 1e-9) if len(self.batches) > 1 else None
        sender.submit(k, list(zip(shard_batch(batch, self.topo.num_learners), self.topo.learner_ranks)), flags, probe_score,
                      busy)
        stats["queue_depth"] = sender.in_flight(k)
        return stats, engine_stats


def steady_busy(batches: list[dict], since: float | None, until: float) -> float | None:
    """The share of [since, until] (unix s) spent collecting (`batches`' collect intervals, clipped
    to it): the steady state's busy share, from the learners' first adapter on; None without one,
    or when no batch was collected after it (a run of one step)."""
    if since is None or until <= since or not any(b["collect_end"] > since for b in batches):
        return None
    inside = sum(max(0.0, min(b["collect_end"], until) - max(b["collect_start"], since)) for b in batches)
    return inside / (until - since)


def rollout_loop(rank: InferenceRank, start: int, role, profiler) -> float:
    """Batches start..S-1 of one inference rank, then the last versions -> seconds spent collecting."""
    cfg = rank.cfg
    num_steps, lag = cfg.learner.num_steps, sampling_lag(cfg)
    sender = TrajectorySender(rank.topo.transport_group, first_index=start)
    t_batch = time.perf_counter()
    for k in range(start, num_steps):
        played = rank.play_batch(k, sender, lag)
        if played is None:
            break
        if k == start:  # queued: the learners' rank 0 takes this rank's start-up marks after its shards
            mark("first_batch")
            send_marks(rank.topo)
        stats, engine_stats = played
        stats["idle_fraction"] = 1.0 - rank.batches[-1]["collect_s"] / max(time.perf_counter() - t_batch, 1e-9)
        t_batch = time.perf_counter()
        rank.writer.scalars("rollout", stats, k)
        rank.writer.scalars("engine", engine_stats, k)
        role.watchdog.beat(k)
        role.check()
        profiler.step()
    rank.take_adapters_through(num_steps)  # finish on the final adapter
    rank.receiver.close()
    sender.close()  # after a stop the learners drain what is in flight
    rank.evaluator.at_end(rank.stopped or rank.stop.requested)
    if eval_enabled(cfg) and rank.topo.role_rank == 0:  # learner rank 0 waits for it (summary.json)
        send_json({"history": rank.evaluator.history}, rank.topo.sync_src, rank.topo.transport_group)
    return sum(b["collect_s"] for b in rank.batches)


def run_inference(cfg: Config, topo: Topology, engine: Engine, env: Env, receiver: AdapterReceiver, *,
                  resume: dict | None, stop: StopSignal, probe: list[int]) -> None:
    """The inference role: play batches, send them to the learners, take adapters as they come."""
    start = resume["trainer_state"]["step"] if resume is not None else 0
    rank = InferenceRank(cfg, topo, engine, env, receiver, stop, probe, start)
    if resume is not None:
        rank.restore(resume)
    t_start = time.perf_counter()
    with role_monitors(cfg.metrics, rank.writer, gpu_index=gpu_index(topo), what="trajectory produced") as role:
        # A vLLM engine built with a profile_dir traces its own GPU work over the role profiler's
        # window; a no-op for any other engine.
        profiler = Profilers(make_profiler(cfg.metrics, "inference", topo.rank, enabled=topo.role_rank == 0),
                             EngineProfileWindow(cfg.metrics, engine))
        try:
            busy_s = rollout_loop(rank, start, role, profiler)
        finally:
            profiler.stop()
        wall = time.perf_counter() - t_start
        steady = steady_busy(rank.batches, rank.steady_from, time.time())
        report = {"rank": topo.rank, "wall_s": wall, "busy_s": busy_s,
                  "busy_fraction": busy_s / max(wall, 1e-9) if steady is None else steady,
                  "memory": memory_peaks(topo.device)}
        send_json(report, topo.sync_src, topo.transport_group)  # learner rank 0 puts it into summary.json
        write_atomic(os.path.join(cfg.metrics.run_dir, f"inference-rank{topo.rank}.json"),
                     {**report, "batches": rank.batches, "gpu_util": role.gpu_util()})
    rank.writer.close()
