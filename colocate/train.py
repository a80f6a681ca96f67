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

import os
import sys
import time

import torch
import torch.distributed as dist

from colocate.config import Config, ConfigError, load_config, parse_overrides, save_config
from colocate.data import TrajectoryBatch
from colocate.envs import env_corpus, make_env
from colocate.metrics import MetricsWriter, write_json_atomic
from colocate.models import add_lora, build_model, load_tokenizer, lora_state
from colocate.rollout.transport import recv_batch, send_batch, shard_batch
from colocate.rollout.worker import RolloutWorker
from colocate.sync import LoraSpec, broadcast_lora, checksum, flatten_lora, receive_lora
from colocate.topology import Topology, build_topology


def parse_config(argv: list[str]) -> tuple[Config, bool]:
    path, overrides, resume = parse_overrides(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return load_config(path, overrides, world_size=world), resume


def build_policy(cfg: Config, tokenizer, device):
    """Base model + LoRA, identical on every rank (seeded), adapter version 0."""
    model = build_model(cfg.model, tokenizer, device)
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.model.seed + 1)
        model = add_lora(model, cfg.lora)
    return model.to(device)


def make_engine(cfg: Config, topo: Topology, model, tokenizer):
    kind = cfg.engine.kind
    if kind == "auto":
        import importlib.util
        kind = "vllm" if topo.device.type == "cuda" and importlib.util.find_spec("vllm") else "hf"
    if kind == "vllm":
        from colocate.engine.vllm import VLLMEngine
        return VLLMEngine.from_config(cfg, topo, tokenizer)
    from colocate.engine.hf import HFEngine
    return HFEngine(model, tokenizer, device=topo.device, seed=cfg.rollout.seed * 1000 + topo.rank)


def run_inference(cfg: Config, topo: Topology, model, tokenizer) -> None:
    engine = make_engine(cfg, topo, model, tokenizer)
    env = make_env(cfg, tokenizer, seed=cfg.rollout.seed * 1000 + topo.rank)
    worker = RolloutWorker(env, engine, groups_per_batch=cfg.rollout.groups_per_step // topo.num_inference,
                           first_group_id=topo.rank * 1_000_000)
    spec = LoraSpec.of(engine.lora_state())
    writer = MetricsWriter(cfg.metrics.run_dir, "inference", enabled=topo.role_rank == 0,
                           tensorboard=cfg.metrics.tensorboard)
    num_steps, lag = cfg.learner.num_steps, cfg.learner.max_policy_lag

    def receive() -> None:
        t0 = time.perf_counter()
        version, tensors, sent_sum = receive_lora(spec, src=topo.sync_src, group=topo.sync_group,
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

    # Sends of batch j complete once the learners start step j, which needs version j to have been
    # received here; so only sends older than k - lag may be waited on at batch k (at most lag + 1
    # batches in flight: bounded memory, no deadlock).
    pending: list[tuple[int, list]] = []
    for k in range(num_steps):
        while engine.version < k - lag:
            receive()
        while pending and pending[0][0] < k - lag:
            for p in pending.pop(0)[1]:
                p.wait()
        batch, stats = worker.collect()
        pending.append((k, [send_batch(shard, dst, topo.transport_group)
                            for shard, dst in zip(shard_batch(batch, topo.num_learners), topo.learner_ranks)]))
        writer.scalars("rollout", {k2: v for k2, v in stats.items() if k2 != "out_tokens_per_s"}, k)
        writer.scalars("engine", {"out_tokens_per_s": stats["out_tokens_per_s"],
                                  "batch_size": stats["samples"]}, k)
    while engine.version < num_steps:
        receive()
    for _, sends in pending:
        for p in sends:
            p.wait()
    writer.close()


def run_learner(cfg: Config, topo: Topology, model, tokenizer) -> None:
    from colocate.learner.learner import Learner
    learner = Learner(cfg, topo, model, tokenizer)
    spec = LoraSpec.of(lora_state(model))
    is_source = topo.rank == topo.sync_src
    writer = MetricsWriter(cfg.metrics.run_dir, "learner", enabled=topo.role_rank == 0,
                           tensorboard=cfg.metrics.tensorboard)
    rewards: list[float] = []
    t_start = time.perf_counter()
    for step in range(cfg.learner.num_steps):
        t0 = time.perf_counter()
        batch = TrajectoryBatch.concat([recv_batch(src, topo.transport_group) for src in topo.inference_ranks])
        wait_s = time.perf_counter() - t0
        stats = learner.train_step(batch)
        sync_s = 0.0
        if is_source:
            sync_s = broadcast_lora(lora_state(model), spec, learner.version, src=topo.sync_src,
                                    group=topo.sync_group, with_checksum=cfg.sync.check_checksum)
        rewards.append(stats["reward"])
        writer.scalars("learner", {**stats, "wait_s": wait_s}, step)
        writer.scalars("rollout", {"reward": stats["reward"], "policy_lag": stats["policy_lag_mean"]}, step)
        writer.scalars("sync", {"broadcast_ms": sync_s * 1e3}, step)
        if step % cfg.metrics.log_every == 0 or step == cfg.learner.num_steps - 1:
            writer.print(f"step {step + 1}/{cfg.learner.num_steps} reward {stats['reward']:.3f} "
                         f"loss {stats['loss']:+.4f} kl {stats['kl']:.4f} clip {stats['clip_fraction']:.3f} "
                         f"lag {stats['policy_lag_mean']:.1f} tok/s {stats['tokens_per_s']:.0f} "
                         f"step {stats['step_s']:.2f}s wait {wait_s:.2f}s")
    if topo.role_rank == 0:
        k = min(10, len(rewards))  # windows of 10 steps: single batches are noisy
        summary = {
            "steps": len(rewards),
            "reward_start": sum(rewards[:k]) / k,
            "reward_end": sum(rewards[-k:]) / k,
            "reward_target": cfg.env.reward_target,
            "reached_target": sum(rewards[-k:]) / k >= cfg.env.reward_target,
            "wall_time_s": time.perf_counter() - t_start,
            "rewards": rewards,
            "env": cfg.env.name,
            "world_size": topo.world_size,
            "num_inference": topo.num_inference,
            "num_learners": topo.num_learners,
        }
        write_json_atomic(os.path.join(cfg.metrics.run_dir, "summary.json"), summary)
        writer.print(f"summary: reward {summary['reward_start']:.3f} -> {summary['reward_end']:.3f} "
                     f"(target {cfg.env.reward_target}) in {summary['wall_time_s']:.0f}s")
    writer.close()


def main(argv: list[str] | None = None) -> None:
    try:
        cfg, _resume = parse_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"colocate: config error: {e}", file=sys.stderr)
        sys.exit(2)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    topo = build_topology(cfg)
    if topo.rank == 0:
        save_config(cfg, os.path.join(cfg.metrics.run_dir, "config.yaml"))
    key, corpus_fn = env_corpus(cfg)
    tokenizer = load_tokenizer(cfg.model, corpus_fn, key)
    model = build_policy(cfg, tokenizer, topo.device)
    try:
        if topo.role == "inference":
            run_inference(cfg, topo, model, tokenizer)
        else:
            run_learner(cfg, topo, model, tokenizer)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
