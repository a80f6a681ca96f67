"""The inference role loop: play games with the engine, ship trajectories, take new adapters.

Protocol (deterministic, so no rank waits on a message that will not come): for batch k = 0..S-1,
receive adapters until the engine's version >= k - lag (`config.sampling_lag`: max_policy_lag, or
one less with oversampled groups, which may be trained a step after their batch), play this
rank's share of groups, send one shard of the batch to every learner (from a sender thread); at
the end receive the remaining versions up to S. Adapter headers carry run-control flags: FLAG_CHECKPOINT (send this
rank's sampler/env state to learner rank 0) and FLAG_STOP (a signal was seen somewhere: stop).
The engine and env are built by the composition root (`train.py`); nothing here knows which
engine it drives, beyond an optional `receive_lora` that lets vLLM take the broadcast in its worker.
"""
from __future__ import annotations

import os
import time

from torch.profiler import record_function

from colocate.config import Config, sampling_lag
from colocate.lifecycle import StopSignal
from colocate.metrics import (EngineProfileWindow, MetricsWriter, Profilers, make_profiler, role_monitors,
                              write_json_atomic)
from colocate.rollout.transport import FLAG_STOP as STOP_REQUESTED
from colocate.rollout.transport import TrajectorySender, send_json, shard_batch
from colocate.rollout.worker import RolloutWorker
from colocate.sync import FLAG_CHECKPOINT, FLAG_STOP, LoraSpec, checksum, flatten_lora, receive_lora
from colocate.topology import Topology, gpu_index


def run_inference(cfg: Config, topo: Topology, engine, env, *, resume: dict | None, stop: StopSignal) -> None:
    """The inference role: play batches, send them to the learners, take adapters as they come."""
    worker = RolloutWorker(env, engine, groups_per_batch=topo.share(cfg.rollout.groups_per_step),
                           first_group_id=topo.rank * 1_000_000, oversample=cfg.rollout.oversample_groups,
                           stream=cfg.rollout.stream)
    spec = getattr(engine, "spec", None) or LoraSpec.of(engine.lora_state())
    writer = MetricsWriter(cfg.metrics.run_dir, "inference", enabled=topo.role_rank == 0,
                           tensorboard=cfg.metrics.tensorboard)
    start = 0
    if resume is not None:  # the adapter and this rank's sampler/env state as of the checkpoint
        start = resume["trainer_state"]["step"]
        engine.load_lora(resume["trainer_state"]["version"], resume["adapter"])
        restore_inference_state(resume["trainer_state"]["inference"].get(str(topo.rank)), worker, env, engine)
    stopped = False

    def receive() -> None:
        nonlocal stopped
        t0 = time.perf_counter()
        if hasattr(engine, "receive_lora"):  # vLLM: the broadcast lands in its worker, which applies it
            got = engine.receive_lora(verify=cfg.sync.check_checksum)  # raises on a checksum/slot mismatch
            version, sent_sum, flags = got["version"], 0, got["flags"]
            sync = {"receive_apply_ms": (time.perf_counter() - t0) * 1e3, "apply_ms": got["apply_ms"],
                    "version": version, **({"checksum_ok": 1.0} if got["checksum_ok"] else {})}
        else:
            version, tensors, sent_sum, flags = receive_lora(spec, src=topo.sync_src, group=topo.sync_group,
                                                             device=topo.device)
            t1 = time.perf_counter()
            engine.load_lora(version, tensors)
            t2 = time.perf_counter()
            sync = {"receive_ms": (t1 - t0) * 1e3, "apply_ms": (t2 - t1) * 1e3, "version": version}
        if sent_sum:  # prove the engine now samples with exactly the learner's bytes
            sync["checksum_ok"] = float(checksum(flatten_lora(engine.lora_state(), spec)) == sent_sum)
            if not sync["checksum_ok"]:
                raise RuntimeError(f"rank {topo.rank}: adapter version {version} differs from the learner's")
        writer.scalars("sync", sync, version)
        if flags & FLAG_CHECKPOINT:  # this rank's part of the checkpoint, taken at this version
            send_json(inference_state(topo.rank, worker, env, engine), topo.sync_src, topo.transport_group)
        stopped = stopped or bool(flags & FLAG_STOP)

    with role_monitors(cfg.metrics, writer, gpu_index=gpu_index(topo), what="trajectory produced") as role:
        profiler = make_profiler(cfg.metrics, "inference", topo.rank, enabled=topo.role_rank == 0)
        try:
            # vLLM built with a profile_dir (metrics.profile, role rank 0): the engine core traces its
            # own GPU work over the same window; a no-op for any other engine
            profiler = Profilers(profiler, EngineProfileWindow(cfg.metrics, engine))
            rollout_loop(cfg, topo, engine, worker, writer, role, profiler, stop, start, receive,
                         is_stopped=lambda: stopped)
        finally:
            profiler.stop()
    writer.close()


BATCH_STATS = ("polls", "samples", "latency_s", "poll_latency_s_p50", "poll_latency_s_p95", "request_latency_s_p50",
               "request_latency_s_p95", "group_latency_s_p95",
               "requests_per_call", "generate_fraction", "out_tokens", "out_tokens_per_s", "prefix_cache_hit_rate",
               "engine_errors", "prefill_tokens", "steps")
"""Rollout and engine scalars kept per batch in `inference-rank<r>.json` (TensorBoard has them all)."""


def rollout_loop(cfg, topo, engine, worker, writer, role, profiler, stop, start, receive, is_stopped) -> None:
    """Batches start..S-1 of one inference rank (see the module docstring for the protocol)."""
    num_steps, lag = cfg.learner.num_steps, sampling_lag(cfg)
    # Sends of batch j complete once the learners start step j, which needs version j to have been
    # received here; so only sends older than k - lag may be waited on at batch k (at most lag + 1
    # batches in flight: bounded memory, no deadlock).
    sender = TrajectorySender(topo.transport_group, first_index=start)
    busy_s, t_start = 0.0, time.perf_counter()
    t_batch = t_start
    # Per batch (e2e profile): collect start/end (unix s), where the rank waited, what the rollout did.
    batches: list[dict] = []
    for k in range(start, num_steps):
        t_wait = time.perf_counter()
        while engine.version < k - lag and not is_stopped():
            receive()
        if is_stopped():
            break
        t_version = time.perf_counter()
        sender.wait_through(k - lag - 1)
        t_collect, u_collect = time.perf_counter(), time.time()
        with record_function("rollout/collect"):
            batch, stats, engine_stats = worker.collect()
        busy_s += time.perf_counter() - t_collect
        batches.append({"collect_start": u_collect, "collect_end": time.time(),
                        "wait_version_s": t_version - t_wait, "wait_send_s": t_collect - t_version,
                        **{key: float(v) for key, v in {**stats, **engine_stats}.items()
                           if key in BATCH_STATS}})
        flags = STOP_REQUESTED if stop.requested else 0  # a signal here reaches the learners in the header
        sender.submit(k, list(zip(shard_batch(batch, topo.num_learners), topo.learner_ranks)), flags)
        stats["idle_fraction"] = 1.0 - (time.perf_counter() - t_collect) / max(time.perf_counter() - t_batch, 1e-9)
        stats["queue_depth"] = sender.in_flight(k)
        t_batch = time.perf_counter()
        writer.scalars("rollout", stats, k)
        writer.scalars("engine", engine_stats, k)
        role.watchdog.beat(k)
        profiler.step()
    while engine.version < num_steps and not is_stopped():
        receive()
    sender.close()  # after a stop the learners drain what is in flight
    wall = time.perf_counter() - t_start
    write_json_atomic(os.path.join(cfg.metrics.run_dir, f"inference-rank{topo.rank}.json"),
                      {"rank": topo.rank, "wall_s": wall, "busy_s": busy_s, "busy_fraction": busy_s / max(wall, 1e-9),
                       "batches": batches, "gpu_util": role.gpu_util()})


def inference_state(rank: int, worker: RolloutWorker, env, engine) -> dict:
    """What an inference rank needs to resume sampling exactly (JSON)."""
    return {"rank": rank, "next_group": worker.next_group,
            "env": env.state_dict() if hasattr(env, "state_dict") else None,
            "engine_rng": engine.rng_state() if hasattr(engine, "rng_state") else None}


def restore_inference_state(state: dict | None, worker: RolloutWorker, env, engine) -> None:
    if state is None:
        return
    worker.next_group = state["next_group"]
    if state.get("env") is not None and hasattr(env, "load_state_dict"):
        env.load_state_dict(state["env"])
    if state.get("engine_rng") is not None and hasattr(engine, "set_rng_state"):
        engine.set_rng_state(state["engine_rng"])
