"""`torchrun --nproc-per-node N -m colocate.train --config CFG [--section.key=value ...]`

The composition root: config -> topology -> tokenizer + model -> the role loop of this rank.

Step protocol (deterministic, so no rank ever waits on a message that will not come):
  * inference rank, batch k = 0..S-1: receive adapters until its version >= k - max_policy_lag,
    play its share of groups, send one shard of the batch to every learner (non-blocking);
    at the end it receives the remaining versions up to S, so it finishes on the final adapter.
  * learner, step s = 0..S-1: receive one shard from every inference rank, train, and learner
    rank 0 broadcasts version s + 1 on the sync group.
With max_policy_lag = L, batch k is sampled with version max(0, k - L) and trained at step k, so
rollouts of batch k + 1 .. k + L overlap the learner's step k; L = 0 is synchronous.

Kept under `if __name__ == "__main__"`: a vLLM engine core re-imports the main module (see
notes/vllm-in-torchrun.md).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import yaml

from colocate.config import Config, ConfigError, load_config, parse_overrides, save_config, to_dict
from colocate.data import TrajectoryBatch
from colocate.envs import env_corpus, make_env
from colocate.lifecycle import StopSignal, checkpoint_fault_hook, maybe_raise, parse_fault
from torch.profiler import record_function

from colocate.metrics import MetricsWriter, make_profiler, role_monitors, write_json_atomic
from colocate.models import add_lora, build_model, canonical_name, load_tokenizer, materialize
from colocate.rollout.transport import FLAG_STOP as STOP_REQUESTED
from colocate.rollout.transport import (TrajectorySender, recv_batch, recv_batch_with_flags, recv_json, send_json,
                                       shard_batch)
from colocate.rollout.worker import RolloutWorker
from colocate.sync import FLAG_CHECKPOINT, FLAG_STOP, LoraSpec, broadcast_lora, checksum, flatten_lora, receive_lora
from colocate.topology import Topology, build_topology


def parse_config(argv: list[str]) -> tuple[Config, bool]:
    path, overrides, resume = parse_overrides(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return load_config(path, overrides, world_size=world), resume


def build_policy(cfg: Config, tokenizer, device):
    """Base model + LoRA, identical on every rank (per-parameter seeds), adapter version 0.

    Built on the meta device and materialized on `device`; device "meta" leaves that to the learner,
    which shards it with FSDP2 first (`colocate.learner.learner.Learner`)."""
    model = build_model(cfg.model, tokenizer, "meta")
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # peft draws its (overwritten) init from the global RNG
        model = add_lora(model, cfg.lora)
    if torch.device(device).type != "meta":
        materialize(model, cfg.model, device)
    return model


def engine_kind(cfg: Config, topo: Topology) -> str:
    """hf or vllm; every rank resolves it alike (learner rank 0 must know how adapters travel)."""
    kind = cfg.engine.kind
    if kind == "auto":
        import importlib.util
        kind = "vllm" if topo.device.type == "cuda" and importlib.util.find_spec("vllm") else "hf"
    return kind


def make_engine(cfg: Config, topo: Topology, model, tokenizer):
    if engine_kind(cfg, topo) == "vllm":
        from colocate.engine.vllm import VLLMEngine
        return VLLMEngine.from_config(cfg, topo, tokenizer)
    from colocate.engine.hf import HFEngine
    return HFEngine(model, tokenizer, device=topo.device, seed=cfg.rollout.seed * 1000 + topo.rank)


def run_inference(cfg: Config, topo: Topology, model, tokenizer, *, resume: dict | None, stop: StopSignal) -> None:
    engine = make_engine(cfg, topo, model, tokenizer)
    env = make_env(cfg, tokenizer, seed=cfg.rollout.seed * 1000 + topo.rank)
    worker = RolloutWorker(env, engine, groups_per_batch=cfg.rollout.groups_per_step // topo.num_inference,
                           first_group_id=topo.rank * 1_000_000)
    spec = getattr(engine, "spec", None) or LoraSpec.of(engine.lora_state())
    writer = MetricsWriter(cfg.metrics.run_dir, "inference", enabled=topo.role_rank == 0,
                           tensorboard=cfg.metrics.tensorboard)
    num_steps, lag = cfg.learner.num_steps, cfg.learner.max_policy_lag
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

    with role_monitors(cfg.metrics, writer, gpu_index=gpu_index(topo), what="trajectory produced") as watchdog:
        profiler = make_profiler(cfg.metrics, "inference", topo.rank, enabled=topo.role_rank == 0)
        try:
            rollout_loop(cfg, topo, engine, worker, writer, watchdog, profiler, stop, start, receive,
                         is_stopped=lambda: stopped)
        finally:
            profiler.stop()
    writer.close()


def gpu_index(topo: Topology) -> int | None:
    return topo.device.index if topo.device.type == "cuda" else None


def rollout_loop(cfg, topo, engine, worker, writer, watchdog, profiler, stop, start, receive, is_stopped) -> None:
    """Batches start..S-1 of one inference rank (see the module docstring for the protocol)."""
    num_steps, lag = cfg.learner.num_steps, cfg.learner.max_policy_lag
    # Sends of batch j complete once the learners start step j, which needs version j to have been
    # received here; so only sends older than k - lag may be waited on at batch k (at most lag + 1
    # batches in flight: bounded memory, no deadlock).
    sender = TrajectorySender(topo.transport_group, first_index=start)
    busy_s, t_start = 0.0, time.perf_counter()
    t_batch = t_start
    for k in range(start, num_steps):
        while engine.version < k - lag and not is_stopped():
            receive()
        if is_stopped():
            break
        sender.wait_through(k - lag - 1)
        t_collect = time.perf_counter()
        with record_function("rollout/collect"):
            batch, stats, engine_stats = worker.collect()
        busy_s += time.perf_counter() - t_collect
        flags = STOP_REQUESTED if stop.requested else 0  # a signal here reaches the learners in the header
        sender.submit(k, list(zip(shard_batch(batch, topo.num_learners), topo.learner_ranks)), flags)
        stats["idle_fraction"] = 1.0 - (time.perf_counter() - t_collect) / max(time.perf_counter() - t_batch, 1e-9)
        stats["queue_depth"] = sender.in_flight(k)
        t_batch = time.perf_counter()
        writer.scalars("rollout", stats, k)
        writer.scalars("engine", engine_stats, k)
        watchdog.beat(k)
        profiler.step()
    while engine.version < num_steps and not is_stopped():
        receive()
    sender.close()  # after a stop the learners drain what is in flight
    wall = time.perf_counter() - t_start
    write_json_atomic(os.path.join(cfg.metrics.run_dir, f"inference-rank{topo.rank}.json"),
                      {"rank": topo.rank, "wall_s": wall, "busy_s": busy_s, "busy_fraction": busy_s / max(wall, 1e-9)})


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


def run_learner(cfg: Config, topo: Topology, model, tokenizer, *, resume: dict | None, stop: StopSignal) -> None:
    from colocate.learner.learner import Learner
    learner = Learner(cfg, topo, model, tokenizer)
    spec = LoraSpec.of(learner.lora_state())  # a gather over the learner group: every learner calls it
    is_source = topo.rank == topo.sync_src
    sender = None  # vLLM engines receive in their worker, over a stateless NCCL group (waits for them)
    if is_source and engine_kind(cfg, topo) == "vllm":
        from colocate.engine.vllm_sync import open_sender
        sender = open_sender(topo, spec, timeout_s=max(900.0, cfg.topology.timeout_s))
    writer = MetricsWriter(cfg.metrics.run_dir, "learner", enabled=topo.role_rank == 0,
                           tensorboard=cfg.metrics.tensorboard)
    fault = parse_fault()
    history: dict[str, list[float]] = {"reward": [], "loss": []}
    start = 0
    if resume is not None:
        start = restore_learner(learner, resume)
        history = {k: list(v) for k, v in resume["trainer_state"]["history"].items()}
    num_steps, lag, ckpt = cfg.learner.num_steps, cfg.learner.max_policy_lag, cfg.checkpoint
    # Daemon threads and a profiler window; an exception ends the process, so no try/finally needed.
    monitors = contextlib.ExitStack()
    watchdog = monitors.enter_context(role_monitors(cfg.metrics, writer, gpu_index=gpu_index(topo),
                                                    what="trajectory consumed"))
    profiler = make_profiler(cfg.metrics, "learner", topo.rank, enabled=topo.role_rank == 0)
    monitors.callback(profiler.stop)
    nonfinite_run, busy_s, dropped = 0, 0.0, 0.0
    t_start = time.perf_counter()
    for step in range(start, num_steps):
        maybe_raise(fault, topo.rank, step)
        t0 = time.perf_counter()
        received = [recv_batch_with_flags(src, topo.transport_group) for src in topo.inference_ranks]
        batch = TrajectoryBatch.concat([b for b, _ in received])
        wait_s = time.perf_counter() - t0
        lags = (learner.version - batch.versions.long()).float()  # [B] policy lag of each sequence
        t_train = time.perf_counter()
        with record_function("learner/train_step"):
            stats = learner.train_step(batch)
        busy_s += time.perf_counter() - t_train
        dropped += stats["dropped_stale"]
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
        adapter = learner.lora_state()  # full tensors from the shards: all learners join the gather
        gather_s, sync_s = time.perf_counter() - t_gather, 0.0
        if sender is not None:
            sync_s = sender.send(adapter, learner.version, with_checksum=cfg.sync.check_checksum, flags=flags,
                                 wait=False)  # like dist.broadcast: later kernels on this stream wait for it
        elif is_source:
            sync_s = broadcast_lora(adapter, spec, learner.version, src=topo.sync_src,
                                    group=topo.sync_group, with_checksum=cfg.sync.check_checksum, flags=flags)
        history["reward"].append(stats["reward"])
        history["loss"].append(stats["loss"])
        if checkpointing:
            write_checkpoint(cfg, topo, learner, adapter, history, step + 1, fault)
        writer.scalars("learner", {**stats, "wait_s": wait_s,
                                   "idle_fraction": wait_s / max(time.perf_counter() - t0, 1e-9)}, step)
        writer.scalars("rollout", {"reward": stats["reward"], "policy_lag": stats["policy_lag_mean"]}, step)
        writer.scalars("sync", {"broadcast_ms": sync_s * 1e3, "gather_ms": gather_s * 1e3}, step)
        if step % cfg.metrics.log_every == 0 or last:
            writer.print(f"step {step + 1}/{num_steps} reward {stats['reward']:.3f} "
                         f"loss {stats['loss']:+.4f} kl {stats['kl']:.4f} clip {stats['clip_fraction']:.3f} "
                         f"lag {stats['policy_lag_mean']:.1f} tok/s {stats['tokens_per_s']:.0f} "
                         f"step {stats['step_s']:.2f}s wait {wait_s:.2f}s")
        if stopping and not last:
            # Batches step+1 .. step+lag were already sampled and sent: receive and drop them, so no
            # inference rank is left blocked in a send.
            for _ in range(min(step + 1 + lag, num_steps) - (step + 1)):
                for src in topo.inference_ranks:
                    recv_batch(src, topo.transport_group)
            writer.print(f"stop requested (signal): checkpoint at step {step + 1}, exiting")
            break
        profiler.step()
    monitors.close()
    if topo.role_rank == 0:
        wall = time.perf_counter() - t_start
        write_summary(cfg, topo, history, wall, writer, {
            "learner_busy_fraction": busy_s / max(wall, 1e-9), "dropped_stale": dropped,
            "steps_per_hour": (len(history["reward"]) - start) / max(wall, 1e-9) * 3600})
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


def load_resume(cfg: Config, resume_flag: bool) -> dict | None:
    """The checkpoint to continue from (validated), or None. `--resume` means checkpoint.resume=auto."""
    from colocate.checkpoint import load_checkpoint, resolve_resume
    path = resolve_resume("auto" if resume_flag and not cfg.checkpoint.resume else cfg.checkpoint.resume,
                          cfg.metrics.run_dir)
    if path is None:
        return None
    state = load_checkpoint(path)
    state["path"] = path
    return state


def main(argv: list[str] | None = None) -> None:
    from colocate.checkpoint import CheckpointError
    try:
        cfg, resume_flag = parse_config(sys.argv[1:] if argv is None else argv)
        resume = load_resume(cfg, resume_flag)  # a corrupt checkpoint is refused before any group forms
    except (ConfigError, CheckpointError) as e:
        kind = "config" if isinstance(e, ConfigError) else "checkpoint"
        print(f"colocate: {kind} error: {e}", file=sys.stderr)
        sys.exit(2)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    stop = StopSignal().install()
    topo = build_topology(cfg)
    if topo.rank == 0:
        save_config(cfg, os.path.join(cfg.metrics.run_dir, "config.yaml"))
        if resume is not None:
            print(f"colocate: resuming from {resume['path']} (step {resume['trainer_state']['step']})", flush=True)
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    # Learners get the policy on the meta device: the Learner shards it, then materializes its shards.
    # A vLLM engine loads its own weights (a model directory), so its rank keeps the meta one too.
    on_device = topo.role == "inference" and engine_kind(cfg, topo) == "hf"
    model = build_policy(cfg, tokenizer, topo.device if on_device else "meta")
    try:
        if topo.role == "inference":
            run_inference(cfg, topo, model, tokenizer, resume=resume, stop=stop)
        else:
            run_learner(cfg, topo, model, tokenizer, resume=resume, stop=stop)
    except BaseException as e:
        # One line that names the rank; torchrun then stops the other ranks (their collectives
        # time out after topology.timeout_s at the latest).
        print(f"colocate: rank {topo.rank} ({topo.role}) failed: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
