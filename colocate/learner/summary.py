"""The end of a learner run: every learner's memory peaks, and learner rank 0's `summary.json`
(rewards, busy shares of the steady state, memory measured beside the plan's estimates, the
timeline, the start-up apart) with its closing lines (the summary, where the run's files are)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from colocate.config import Config
from colocate.jsonfile import read_object, write_atomic
from colocate.topology import Topology


@dataclass(frozen=True)
class SteadyState:
    """The run after its first step (the start-up is `startup.json`'s): the busy shares' window."""
    wall_s: float = 0.0   # end of the first step -> now
    busy_s: float = 0.0   # learner rank 0's time in `train_step` in it
    steps: int = 0        # steps in it

    @classmethod
    def since(cls, first_step_end: tuple[float, float] | None, busy_s: float, steps_run: int) -> "SteadyState":
        """From `LearnerRank.steady_from` ((perf_counter, busy_s) at the end of the first step)."""
        if first_step_end is None or steps_run < 2:
            return cls()
        t, busy_then = first_step_end
        return cls(time.perf_counter() - t, busy_s - busy_then, steps_run - 1)


@dataclass(frozen=True)
class RunFigures:
    """What learner rank 0 gathered at the end of the loop, beside its own history."""
    wall_s: float
    start_step: int
    gpu_util: dict
    learner_memory: dict  # learner_memory(): {global rank: peaks}
    evaluation: dict      # inference rank 0's held-out evaluations ({} without eval)
    reports: list         # each inference rank's {"rank", "busy_fraction", "memory"}
    steady: SteadyState = SteadyState()  # no steps after the first: the busy shares cover the whole run


def learner_memory(topo: Topology) -> dict[str, dict]:
    """{global rank: memory peaks} of every learner, gathered to learner rank 0 (empty elsewhere and on CPU)."""
    from colocate.metrics import memory_peaks
    if topo.device.type != "cuda":
        return {}
    mine = memory_peaks(topo.device)
    keys = ("allocated", "reserved", "device_used_at_end")
    local = torch.tensor([mine.get(k, -1.0) for k in keys], device=topo.device)
    every = [torch.empty_like(local) for _ in range(topo.num_learners)]
    dist.all_gather(every, local, group=topo.learner_group)
    return {str(r): {k: round(float(v), 2) for k, v in zip(keys, t.tolist()) if v >= 0}
            for r, t in zip(topo.learner_ranks, every)}


def run_files(cfg: Config) -> str:
    """The end-of-run line: where this run's files are."""
    from colocate.metrics import profile_out_dir
    m = cfg.metrics
    parts = [f"run dir {m.run_dir}", f"adapter {os.path.join(m.run_dir, 'adapter')}",
             f"summary {os.path.join(m.run_dir, 'summary.json')}"]
    if m.tensorboard and "tensorboard" in m.loggers:
        parts.append(f"TensorBoard: tensorboard --logdir {os.path.join(m.run_dir, 'tb')}")
    if cfg.checkpoint.enabled:
        parts.append(f"checkpoints {os.path.join(m.run_dir, 'checkpoints')}")
    if m.profile:
        parts.append(f"profiler traces {profile_out_dir(m)}")
    return "files: " + "; ".join(parts)


def eval_summary(evaluation: dict) -> dict:
    """summary.json's eval fields: every evaluation, and the last one's metrics."""
    history = evaluation.get("history", [])
    return {"eval": history, "eval_final": history[-1] if history else {}} if evaluation else {}


def reward_windows(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first and last windows of up to 10 steps (single batches are noisy); on
    short runs each window is at most half the run, so the two never overlap."""
    k = max(1, min(10, len(rewards) // 2))
    if not rewards:
        return 0.0, 0.0
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def run_figures(cfg: Config, rank, figures: RunFigures) -> dict:
    """summary.json's fields beyond the rewards: busy shares, memory (measured and planned), the
    timeline, the stops. `rank` is the loop's `LearnerRank`."""
    wall, reports, steady = max(figures.wall_s, 1e-9), figures.reports, figures.steady
    return {
        **eval_summary(figures.evaluation),
        # the steady state's (from step 2), as the step lines say; the start-up is `startup`
        "learner_busy_fraction": steady.busy_s / steady.wall_s if steady.steps else rank.busy_s / wall,
        "inference_busy_fraction": sum(r["busy_fraction"] for r in reports) / len(reports),
        "busy_from_step": figures.start_step + 2 if steady.steps else figures.start_step + 1,
        "startup": rank.startup,
        "memory_peak_gib": {**{str(r["rank"]): r["memory"] for r in reports}, **figures.learner_memory},
        "memory_plan_gib": read_object(os.path.join(cfg.metrics.run_dir, "memory_plan.json"), missing_ok=True),
        "dropped_stale": rank.dropped,
        "steps_per_hour": (len(rank.history["reward"]) - figures.start_step) / wall * 3600,
        "timeline": [row.to_json() for row in rank.timeline],
        "gpu_util": figures.gpu_util,
        "collapse_step": rank.collapsed_at,
        "mismatch_step": rank.mismatch_at,
    }


def write_summary(cfg: Config, topo: Topology, rank, figures: RunFigures) -> None:
    """<run_dir>/summary.json, then the summary line and (the sync source) where the files are."""
    history, writer, wall_s = rank.history, rank.writer, figures.wall_s
    rewards = history["reward"]
    reward_start, reward_end = reward_windows(rewards)
    summary = {
        "steps": len(rewards),
        "reward_start": reward_start,
        "reward_end": reward_end,
        "reward_target": cfg.env.reward_target,
        "reached_target": bool(rewards) and reward_end >= cfg.env.reward_target,
        "wall_time_s": wall_s,
        "rewards": rewards,
        "losses": history["loss"],
        "reward_errors": int(sum(history["reward_errors"])),  # samples no reward function could score
        "env": cfg.env.name,
        "world_size": topo.world_size,
        "num_inference": topo.num_inference,
        "num_learners": topo.num_learners,
        "max_policy_lag": cfg.learner.max_policy_lag,
        **run_figures(cfg, rank, figures),
    }
    write_atomic(os.path.join(cfg.metrics.run_dir, "summary.json"), summary)
    busy = "".join(f", {name} {summary[key]:.0%} busy" for name, key in
                   (("learners", "learner_busy_fraction"), ("inference", "inference_busy_fraction")) if key in summary)
    errors = summary["reward_errors"]
    writer.print(f"summary: reward {summary['reward_start']:.3f} -> {summary['reward_end']:.3f} "
                 f"(target {cfg.env.reward_target}) in {wall_s:.0f}s{busy}"
                 + (f"; {errors} samples got no usable reward from a reward function (scored 0 from it; "
                    "the first fault of each kind was logged above; rollout/reward_errors per step)" if errors else ""))
    if topo.rank == topo.sync_src:
        writer.print(run_files(cfg))
