"""The PyTorch reference GRPO loss: slow, obviously right, the twin of the Triton kernel.

Per completion token t (rows of `logits`):
    logp_t  = log_softmax(logits_t / temperature)[target_t]
    ratio_t = exp(logp_t - behaviour_t)
    l_t     = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
              + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)          # k3 KL
    loss    = sum_t w_t * mask_t * l_t
with w_t from `token_weights` (the normalization mode). Both implementations receive the same
weights, so the modes live in one place.
"""
from __future__ import annotations

import torch

NORM_MODES = ("grpo", "dapo", "dr_grpo")


def token_weights(
    mask: torch.Tensor,                  # [N] bool/float
    norm: str,
    seq_ids: torch.Tensor | None = None,  # [N] int64 sequence index of each row
    num_seqs: int | None = None,          # sequences in the (global) batch
    max_len: int | None = None,           # dr_grpo: the fixed completion length
    num_tokens: int | float | None = None,  # dapo: trained tokens in the (global) batch
) -> torch.Tensor:                        # [N] float32
    """Per-token weight w_t so that loss = sum_t w_t * mask_t * l_t.

    grpo:    mean over sequences of each sequence's token mean -> 1 / (num_seqs * len(seq(t)))
    dapo:    mean over all trained tokens                      -> 1 / num_tokens
    dr_grpo: sum over tokens / (num_seqs * max_len)            -> 1 / (num_seqs * max_len)
    Pass the global num_seqs / num_tokens when a batch is split over micro-batches or ranks.
    """
    m = mask.float()
    if norm == "dapo":
        n = float(num_tokens) if num_tokens is not None else float(m.sum())
        return m / max(n, 1.0)
    if seq_ids is None:
        raise ValueError(f"norm={norm!r} needs seq_ids")
    seq_ids = seq_ids.long()
    nseq_local = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    if num_seqs is None:
        num_seqs = nseq_local
    if norm == "grpo":
        lens = torch.zeros(nseq_local, dtype=torch.float32, device=m.device).index_add_(0, seq_ids, m)
        return m / (lens[seq_ids].clamp(min=1.0) * max(num_seqs, 1))
    if norm == "dr_grpo":
        if max_len is None:
            raise ValueError("norm='dr_grpo' needs max_len")
        return m / float(max(num_seqs, 1) * max_len)
    raise ValueError(f"unknown norm {norm!r}; expected one of {NORM_MODES}")


def per_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N, V], [N] -> [N] float32 log-probs of targets (materializes a float32 [N, V]: reference only)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(1, targets.long().unsqueeze(1)).squeeze(1)


def grpo_token_terms(logp, behaviour_logprobs, advantages, ref_logprobs, eps_low, eps_high, beta):
    """Per-token loss and stats inputs from per-token log-probs (all [N])."""
    ratio = torch.exp(logp - behaviour_logprobs)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    is_clipped = ((advantages > 0) & (ratio > 1.0 + eps_high)) | ((advantages < 0) & (ratio < 1.0 - eps_low))
    kl = torch.zeros_like(logp)
    if ref_logprobs is not None and beta > 0:
        delta = ref_logprobs - logp
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + beta * kl
    return loss, ratio, kl, is_clipped


def grpo_loss_reference(
    logits: torch.Tensor,              # [N, V] bf16/fp32
    targets: torch.Tensor,             # [N] int
    weights: torch.Tensor,             # [N] float32 = mask * normalization (token_weights)
    behaviour_logprobs: torch.Tensor,  # [N] float32
    advantages: torch.Tensor,          # [N] float32
    ref_logprobs: torch.Tensor | None = None,  # [N] float32
    *,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Differentiable reference: returns (scalar loss, detached stats over rows with weight > 0)."""
    logp = per_token_logprobs(logits, targets, temperature)
    loss_t, ratio, kl, is_clipped = grpo_token_terms(
        logp, behaviour_logprobs.float(), advantages.float(),
        None if ref_logprobs is None else ref_logprobs.float(), eps_low, eps_high, beta)
    loss = (weights.float() * loss_t).sum()
    return loss, token_stats(weights, ratio, kl, is_clipped)


def token_stats(weights, ratio, kl, is_clipped) -> dict[str, torch.Tensor]:
    """Means over the trained tokens (weight > 0), detached."""
    active = (weights > 0).float()
    n = active.sum().clamp(min=1.0)
    return {
        "clip_fraction": (is_clipped.float() * active).sum().detach() / n,
        "kl": (kl.float() * active).sum().detach() / n,
        "ratio": (ratio.float() * active).sum().detach() / n,
        "num_tokens": active.sum().detach(),
    }
