"""The learner step's statistics by name: what each micro-batch stacks on the device, what one
update reduces over the learner ranks, a batch's counts, and the step's stats dict built from them
(`Learner.train_step`). Nothing here touches a process group."""
from __future__ import annotations

import time

import torch

MICRO_BATCH_STATS = ("loss", "clipped", "kl", "ratio", "tokens", "is_weight", "mis_masked_seqs", "entropy",
                     "ratio_max")
"""One micro-batch's statistics, stacked in this order on the device (nothing read back until the
step's one reduction): its loss; over its n trained tokens, n times the mean clip fraction, KL,
ratio, importance weight and entropy, and n itself; its masked sequences; its largest ratio (the
one column reduced by max, not summed: kept last)."""
STEP_STATS = (*MICRO_BATCH_STATS[:-1], "model_tokens", "ratio_max")
"""One update's statistics summed (ratio_max: maxed) over the learner ranks, and the model tokens run."""
BATCH_COUNTS = ("tokens", "sequences", "reward", "lag", "dropped", "flat_tokens", "zero_adv")
"""A batch's counts summed over the learner ranks (`Learner._global_counts`): trained completion
tokens, sequences, reward sum, lag sum, dropped (stale) sequences, tokens of the sequences laid
flat, sequences with a zero advantage."""


def by_name(values: torch.Tensor, names: tuple[str, ...]) -> dict[str, float]:
    """A reduced statistics vector -> {name: value}, read back to the host once."""
    return dict(zip(names, values.tolist(), strict=True))


def signal_fraction(counts: dict[str, float]) -> float:
    """The fraction of a batch's sequences with a nonzero advantage, from its global counts
    (`BATCH_COUNTS`); 0 for an empty batch."""
    return (counts["sequences"] - counts["zero_adv"]) / counts["sequences"] if counts["sequences"] else 0.0


def step_stats(counts: dict[str, float], updates: list, t0: float) -> dict[str, float]:
    """Stats of the batch from its `counts` and each update's ([STEP_STATS], grad norm, skipped,
    passes): the loss and grad norm (before clipping) are means over the updates, the token stats
    over every trained token, ratio_max and grad_norm_max over all of them."""
    per_update = [by_name(u[0], STEP_STATS) for u in updates]
    s = {k: sum(p[k] for p in per_update) for k in STEP_STATS}
    s["ratio_max"] = max(p["ratio_max"] for p in per_update)
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
        "ratio_max": s["ratio_max"],
        "zero_adv_fraction": counts["zero_adv"] / num_seqs,
        "grad_norm": sum(float(u[1]) for u in updates) / len(updates),
        "grad_norm_max": max(float(u[1]) for u in updates),
        "reward": counts["reward"] / num_seqs,
        "policy_lag_mean": counts["lag"] / num_seqs,
        "dropped_stale": counts["dropped"],
        "tokens": s["tokens"],
        "model_tokens": s["model_tokens"],
        "tokens_forwarded": s["model_tokens"],  # with prefix sharing: shared prompt tokens once
        "tokens_flat_equivalent": counts["flat_tokens"],  # what flat packing would forward
        "micro_batches": float(sum(u[3] for u in updates)),
        "updates": float(len(updates)),
        "skipped_update": float(any(u[2] for u in updates)),
        "step_s": elapsed,
        "tokens_per_s": s["tokens"] / max(elapsed, 1e-9),
    }
