"""The learner step's statistics by name: what each micro-batch stacks on the device, what one
update reduces over the learner ranks, a batch's counts, and the step's stats dict built from them
(`Learner.train_step`). Nothing here touches a process group."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

MICRO_BATCH_STATS = ("loss", "clipped", "kl", "ratio", "tokens", "is_weight", "mis_masked_seqs", "entropy")
"""One micro-batch's sums, stacked in this order on the device (nothing read back until the step's
one reduction): its loss; over its n trained tokens, n times the mean clip fraction, KL, ratio,
importance weight and entropy, and n itself; its masked sequences. Its largest ratio is reduced by
max, not summed, and travels beside them (`UpdateResult.ratio_max`)."""
STEP_STATS = (*MICRO_BATCH_STATS, "model_tokens")
"""One update's statistics summed over the learner ranks, and the model tokens run."""
BATCH_COUNTS = ("tokens", "sequences", "reward", "lag", "dropped", "flat_tokens", "zero_adv", "reward_errors")
"""A batch's counts summed over the learner ranks (`Learner._global_counts`): trained completion
tokens, sequences, reward sum, lag sum, dropped (stale) sequences, tokens of the sequences laid
flat, sequences with a zero advantage, sequences without a usable reward."""


@dataclass(frozen=True)
class UpdateResult:
    """One optimizer update (`Learner._update`), reduced over the learner ranks; tensors stay on the
    device until `step_stats` reads them back."""
    sums: torch.Tensor        # [STEP_STATS] summed over the ranks
    ratio_max: torch.Tensor   # [] the largest ratio of any trained token on any rank
    grad_norm: torch.Tensor   # [] the global grad norm before clipping
    skipped: bool             # a non-finite loss or grad norm: AdamW did not step
    passes: int               # forward/backward passes (micro-batches) each rank ran


def by_name(values: torch.Tensor, names: tuple[str, ...]) -> dict[str, float]:
    """A reduced statistics vector -> {name: value}, read back to the host once."""
    return dict(zip(names, values.tolist(), strict=True))


def signal_fraction(counts: dict[str, float]) -> float:
    """The fraction of a batch's sequences with a nonzero advantage, from its global counts
    (`BATCH_COUNTS`); 0 for an empty batch."""
    return (counts["sequences"] - counts["zero_adv"]) / counts["sequences"] if counts["sequences"] else 0.0


def step_stats(counts: dict[str, float], updates: list[UpdateResult], t0: float) -> dict[str, float]:
    """Stats of the batch from its `counts` and each update: the loss and grad norm (before
    clipping) are means over the updates, the token stats over every trained token, ratio_max and
    grad_norm_max over all of them."""
    per_update = [by_name(u.sums, STEP_STATS) for u in updates]
    s = {k: sum(p[k] for p in per_update) for k in STEP_STATS}
    num_seqs = max(counts["sequences"], 1.0)
    denom = max(s["tokens"], 1.0)
    elapsed = time.perf_counter() - t0
    return {
        "loss": s["loss"] / len(updates),
        "clip_fraction": s["clipped"] / denom,
        "kl": s["kl"] / denom,
        "ratio": s["ratio"] / denom,
        "is_weight": s["is_weight"] / denom,
        "mis_masked_seqs": s["mis_masked_seqs"],  # each sequence is in one mini-batch
        "entropy": s["entropy"] / denom,
        "ratio_max": max(float(u.ratio_max) for u in updates),
        "zero_adv_fraction": counts["zero_adv"] / num_seqs,
        "grad_norm": sum(float(u.grad_norm) for u in updates) / len(updates),
        "grad_norm_max": max(float(u.grad_norm) for u in updates),
        "reward": counts["reward"] / num_seqs,
        "reward_errors": counts["reward_errors"],
        "policy_lag_mean": counts["lag"] / num_seqs,
        "dropped_stale": counts["dropped"],
        "tokens": s["tokens"],
        "model_tokens": s["model_tokens"],
        "tokens_forwarded": s["model_tokens"],  # with prefix sharing: shared prompt tokens once
        "tokens_flat_equivalent": counts["flat_tokens"],  # what flat packing would forward
        "micro_batches": float(sum(u.passes for u in updates)),
        "updates": float(len(updates)),
        "skipped_update": float(any(u.skipped for u in updates)),
        "step_s": elapsed,
        "tokens_per_s": s["tokens"] / max(elapsed, 1e-9),
    }
