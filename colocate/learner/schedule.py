"""What a batch's update follows, from the batch and the version alone: which sequences are fresh
enough to train on (`drop_stale`), the learning rate of the batch (`lr_factor`), and with
`learner.updates_per_batch` > 1 its mini-batch split (`mini_batch_indices`, `mini_batch_seed`).
No model, no process group: a resumed run, which restores the version, repeats them."""
from __future__ import annotations

import math

import torch

from colocate.data import TrajectoryBatch


def drop_stale(batch: TrajectoryBatch, version: int, max_policy_lag: int) -> tuple[TrajectoryBatch, float, int]:
    """Drop sequences sampled more than `max_policy_lag` versions before `version` -> (the kept
    batch, the sum of the kept sequences' lags, how many were dropped)."""
    lag = version - batch.versions.long()
    keep = (lag <= max_policy_lag).nonzero().flatten().tolist()
    dropped = batch.num_sequences - len(keep)
    lag_sum = float(lag[keep].float().sum()) if keep else 0.0
    return (batch.select(keep) if dropped else batch), lag_sum, dropped


def lr_factor(step: int, lc) -> float:
    """The learning rate of batch `step` (0-based) as a fraction of `learner.lr`: a linear warm-up
    over `warmup_steps`, then constant or half a cosine down to `min_lr_ratio` at the last step.
    A function of the step alone, so a resumed run (which restores the version) continues it."""
    if step < lc.warmup_steps:
        return (step + 1) / lc.warmup_steps
    if lc.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - lc.warmup_steps) / max(lc.num_steps - 1 - lc.warmup_steps, 1))
    return lc.min_lr_ratio + (1.0 - lc.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def mini_batch_indices(num_sequences: int, k: int, seed: int) -> list[list[int]]:
    """K shuffled mini-batches of sequence indices (sizes differ by at most one), each in batch
    order; the same seed gives the same split (a resumed run repeats it)."""
    perm = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed)).tolist()
    bounds = [round(i * num_sequences / k) for i in range(k + 1)]
    return [sorted(perm[bounds[i]: bounds[i + 1]]) for i in range(k)]


def mini_batch_seed(rollout_seed: int, version: int) -> int:
    """The seed of one batch's mini-batch split: fixed by the run's seed and the batch's version."""
    return rollout_seed * 1_000_003 + version
