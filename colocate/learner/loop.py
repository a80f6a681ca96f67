"""The learner role loop: receive trajectory shards, train, broadcast the adapter, checkpoint.

Per step s: receive one shard from every inference rank -> `Learner.train_step` -> every learner
joins the adapter gather -> learner rank 0 broadcasts version s + 1 with run-control flags ->
(on schedule, at the end or on a stop) a checkpoint. A non-finite loss skips the update (the
Learner does that) and `metrics.max_nonfinite_steps` in a row end the run. This module never
imports an engine: how adapters reach vLLM is the `sender` the composition root passes in.
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import yaml
from torch.profiler import record_function

from colocate.config import Config, sampling_lag, to_dict
from colocate.data import TrajectoryBatch
from colocate.lifecycle import StopSignal, checkpoint_fault_hook, maybe_poison, maybe_raise, parse_fault
from colocate.metrics import MetricsWriter, make_profiler, role_monitors, write_json_atomic
from colocate.models import canonical_name
from colocate.rollout.transport import FLAG_STOP as STOP_REQUESTED
from colocate.rollout.transport import recv_batch, recv_batch_with_flags, recv_json
from colocate.sync import FLAG_CHECKPOINT, FLAG_STOP, LoraSpec, broadcast_lora, unflatten_lora
from colocate.topology import Topology, gpu_index


def run_learner(cfg: Config, topo: Topology, learner, spec: LoraSpec, *, sender=None, resume: dict | None,
                stop: StopSignal) -> None:
    """The learner role: receive shards, train, hand the adapter to the inference ranks.

    `sender` (learner rank 0 only, optional) replaces the torch.distributed broadcast, e.g. the
    stateless NCCL group into vLLM workers; it is built by the composition root."""
    if learner.lora_spec != spec:  # the flat buffer goes out unlabelled: its layout must be the spec's
        raise ValueError("the learner's adapter layout differs from the sync spec (names, shapes or dtype)")
    is_source = topo.rank == topo.sync_src
    writer = MetricsWriter(cfg.metrics.run_dir, "learner", enabled=topo.role_rank == 0,
                           tensorboard=cfg.metrics.tensorboard)
    fault = parse_fault()
    history: dict[str, list[float]] = {"reward": [], "loss": []}
    start = 0
    if resume is not None:
        start = restore_learner(learner, resume)
        history = {k: list(v) for k, v in resume["trainer_state"]["history"].items()}
    # the inference ranks run up to `lag` batches ahead of this loop (what a stop must drain)
    num_steps, lag, ckpt = cfg.learner.num_steps, sampling_lag(cfg), cfg.checkpoint
    # Daemon threads and a profiler window; an exception ends the process, so no try/finally needed.
    monitors = contextlib.ExitStack()
    role = monitors.enter_context(role_monitors(cfg.metrics, writer, gpu_index=gpu_index(topo),
                                                what="trajectory consumed"))
    watchdog = role.watchdog
    profiler = make_profiler(cfg.metrics, "learner", topo.rank, enabled=topo.role_rank == 0)
    monitors.callback(profiler.stop)
    nonfinite_run, busy_s, dropped = 0, 0.0, 0.0
    # Per step: [wait start, train start, train end, step end (unix s), policy lag mean, adapter
    # gather s, adapter send s]; the e2e benchmark takes steady-state figures from it.
    timeline: list[list[float]] = []
    block_params = sum(p.numel() for n, p in learner.model.named_parameters() if ".layers." in n and "lora_" not in n)
    t_start = time.perf_counter()
    for step in range(start, num_steps):
        maybe_raise(fault, topo.rank, step)
        t0, u0 = time.perf_counter(), time.time()
        received = [recv_batch_with_flags(src, topo.transport_group) for src in topo.inference_ranks]
        batch = TrajectoryBatch.concat([b for b, _ in received])
        # the last adapter's sends to vLLM engines (wait=False below) count as waiting, not training
        send_wait_s = sender.wait_sent() if sender is not None else 0.0
        wait_s = time.perf_counter() - t0
        maybe_poison(fault, step, batch)
        lags = (learner.version - batch.versions.long()).float()  # [B] policy lag of each sequence
        t_train, u_train = time.perf_counter(), time.time()
        with record_function("learner/train_step"):
            stats = learner.train_step(batch)
        busy_s += time.perf_counter() - t_train
        u_trained = time.time()
        dropped += stats["dropped_stale"]
        # Model FLOPs utilization of the decoder-block GEMMs (forward + input-gradient: 4 x params x
        # tokens; frozen base, no weight gradients), over the configured per-device peak. The trainer
        # benchmark adds attention and the lm_head (profiles/trainer.md).
        stats["mfu"] = 4 * block_params * stats["model_tokens"] / max(
            stats["step_s"] * topo.num_learners * cfg.metrics.peak_tflops * 1e12, 1e-9)
        writer.histogram("learner/policy_lag", lags, step)
        watchdog.beat(step)
        if not math.isfinite(stats["loss"]):  # the learner skipped the update; K in a row is fatal
            nonfinite_run += 1
            writer.alert("nonfinite_loss", f"loss {stats['loss']} at step {step + 1}: update skipped "
                         f"({nonfinite_run} in a row, limit {cfg.metrics.max_nonfinite_steps})", step)
            if nonfinite_run >= cfg.metrics.max_nonfinite_steps:
                raise RuntimeError(f"{nonfinite_run} non-finite losses in a row (metrics.max_nonfinite_steps); "
                                   f"last at step {step + 1}: lower learner.lr or check the data")
        else:
            nonfinite_run = 0
        # Stop when any rank saw a signal; every learner must agree (one all-reduce).
        stop_now = torch.tensor([float(stop.requested or any(f & STOP_REQUESTED for _, f in received))],
                                device=topo.device)
        if topo.num_learners > 1:
            dist.all_reduce(stop_now, op=dist.ReduceOp.MAX, group=topo.learner_group)
        stopping = bool(stop_now.item())
        last = step == num_steps - 1
        checkpointing = ckpt.enabled and (stopping or last or (ckpt.every > 0 and (step + 1) % ckpt.every == 0))
        flags = (FLAG_CHECKPOINT if checkpointing else 0) | (FLAG_STOP if stopping and not last else 0)
        t_gather = time.perf_counter()
        flat = learner.lora_flat()  # [numel] full adapter from the shards: all learners join the gather
        gather_s, sync_s = time.perf_counter() - t_gather, 0.0
        if sender is not None:
            sync_s = sender.send(flat, learner.version, with_checksum=cfg.sync.check_checksum, flags=flags,
                                 wait=False)  # like dist.broadcast: later kernels on this stream wait for it
        elif is_source:
            sync_s = broadcast_lora(flat, spec, learner.version, src=topo.sync_src,
                                    group=topo.sync_group, with_checksum=cfg.sync.check_checksum, flags=flags)
        adapter = unflatten_lora(flat, spec)  # views, for the checkpoint
        history["reward"].append(stats["reward"])
        history["loss"].append(stats["loss"])
        if checkpointing:
            write_checkpoint(cfg, topo, learner, adapter, history, step + 1, fault)
        writer.scalars("learner", {**stats, "wait_s": wait_s,
                                   "idle_fraction": wait_s / max(time.perf_counter() - t0, 1e-9)}, step)
        writer.scalars("rollout", {"reward": stats["reward"], "policy_lag": stats["policy_lag_mean"]}, step)
        writer.scalars("sync", {"broadcast_ms": sync_s * 1e3, "gather_ms": gather_s * 1e3,
                                "send_wait_ms": send_wait_s * 1e3}, step)
        if step % cfg.metrics.log_every == 0 or last:
            writer.print(f"step {step + 1}/{num_steps} reward {stats['reward']:.3f} "
                         f"loss {stats['loss']:+.4f} kl {stats['kl']:.4f} clip {stats['clip_fraction']:.3f} "
                         f"lag {stats['policy_lag_mean']:.1f} tok/s {stats['tokens_per_s']:.0f} "
                         f"step {stats['step_s']:.2f}s wait {wait_s:.2f}s")
        timeline.append([u0, u_train, u_trained, time.time(), stats["policy_lag_mean"], gather_s, sync_s])
        if stopping and not last:
            # Batches step+1 .. step+lag were already sampled and sent: receive and drop them, so no
            # inference rank is left blocked in a send.
            for _ in range(min(step + 1 + lag, num_steps) - (step + 1)):
                for src in topo.inference_ranks:
                    recv_batch(src, topo.transport_group)
            writer.print(f"stop requested (signal): checkpoint at step {step + 1}, exiting")
            break
        profiler.step()
    if sender is not None:  # every engine asks for the last version; exiting first would strand it
        sender.wait_sent()
    gpu_util = role.gpu_util()
    monitors.close()
    if topo.role_rank == 0:
        wall = time.perf_counter() - t_start
        write_summary(cfg, topo, history, wall, writer, {
            "learner_busy_fraction": busy_s / max(wall, 1e-9), "dropped_stale": dropped,
            "steps_per_hour": (len(history["reward"]) - start) / max(wall, 1e-9) * 3600,
            "timeline": timeline, "gpu_util": gpu_util})
    writer.close()


def restore_learner(learner, resume: dict) -> int:
    """Adapter, optimizer and RNG from a checkpoint; returns the step to continue from."""
    from colocate.checkpoint import check_adapter_matches, unflatten_optimizer
    live = {canonical_name(n): p for n, p in learner.model.named_parameters() if "lora_" in n}
    check_adapter_matches(resume["adapter"], live, resume["path"])
    with torch.no_grad():
        for name, param in live.items():
            src = resume["adapter"][name]
            if hasattr(param, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor
                src = distribute_tensor(src.to(param.dtype), param.device_mesh, param.placements)
            param.copy_(src)
    params = [p for group in learner.optimizer.param_groups for p in group["params"]]
    learner.optimizer.load_state_dict(unflatten_optimizer(resume["optimizer_tensors"], resume["optimizer_meta"], params))
    torch.set_rng_state(resume["rng"]["torch_cpu"])
    learner.version = resume["trainer_state"]["version"]
    return resume["trainer_state"]["step"]


def write_checkpoint(cfg: Config, topo: Topology, learner, adapter: dict, history: dict, step: int,
                     fault: dict) -> None:
    """Every learner joins the optimizer-state gather; learner rank 0 collects the inference ranks'
    states and writes the checkpoint atomically."""
    from colocate.checkpoint import checkpoint_root, flatten_optimizer, peft_config_dict, save_checkpoint
    # Gathering DTensor optimizer state (FSDP2) is a collective: every learner flattens it.
    optimizer_state = flatten_optimizer(learner.optimizer.state_dict())
    if topo.rank != topo.sync_src:
        return
    inference = {str(r): recv_json(r, topo.transport_group) for r in topo.inference_ranks}
    trainer_state = {"step": step, "version": learner.version, "history": history, "inference": inference}
    path = save_checkpoint(
        checkpoint_root(cfg.metrics.run_dir), step, adapter=adapter, peft_config=peft_config_dict(learner.model),
        optimizer=optimizer_state, rng={"torch_cpu": torch.get_rng_state()}, trainer_state=trainer_state,
        config_yaml=yaml.safe_dump(to_dict(cfg), sort_keys=False), keep=cfg.checkpoint.keep,
        fault_hook=checkpoint_fault_hook(fault, step))
    print(f"[learner] checkpoint written: {path}", flush=True)


def write_summary(cfg: Config, topo: Topology, history: dict, wall_s: float, writer: MetricsWriter,
                  extra: dict) -> None:
    rewards = history["reward"]
    k = min(10, len(rewards))  # windows of 10 steps: single batches are noisy
    summary = {
        "steps": len(rewards),
        "reward_start": sum(rewards[:k]) / max(k, 1),
        "reward_end": sum(rewards[-k:]) / max(k, 1),
        "reward_target": cfg.env.reward_target,
        "reached_target": bool(rewards) and sum(rewards[-k:]) / k >= cfg.env.reward_target,
        "wall_time_s": wall_s,
        "rewards": rewards,
        "losses": history["loss"],
        "env": cfg.env.name,
        "world_size": topo.world_size,
        "num_inference": topo.num_inference,
        "num_learners": topo.num_learners,
        "max_policy_lag": cfg.learner.max_policy_lag,
        **extra,
    }
    write_json_atomic(os.path.join(cfg.metrics.run_dir, "summary.json"), summary)
    writer.print(f"summary: reward {summary['reward_start']:.3f} -> {summary['reward_end']:.3f} "
                 f"(target {cfg.env.reward_target}) in {wall_s:.0f}s")
