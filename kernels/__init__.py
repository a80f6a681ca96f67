"""GRPO loss: one entry (`grpo_loss`), a Triton kernel on CUDA and a PyTorch reference elsewhere.

The learner calls only `grpo_loss`. It
  1. restricts the vocabulary to the constraint's allowed ids when given (the sampler's mask), by
     gathering those logits into a small [N, K] problem: the same masked log-softmax the engine
     sampled from, at a fraction of the cost;
  2. turns the normalization mode into per-token weights (`token_weights`);
  3. dispatches to the fused kernel (CUDA, `impl` auto/triton: `triton_grpo`, whose row launch
     `triton_rows` runs the bulk-copy CUDA row kernel `cuda_grpo` on sm_90 with bf16 logits) or the
     reference (`impl` torch).

This package imports nothing from the rest of colocate (it is installed as `colocate.kernels` but
stands alone); Triton is imported only when the fused kernel runs.
"""
from __future__ import annotations

import torch

from .reference import NORM_MODES, grpo_loss_reference, token_weights

__all__ = ["grpo_loss", "grpo_loss_reference", "token_weights", "NORM_MODES", "restrict_to_allowed"]


def restrict_to_allowed(logits: torch.Tensor, targets: torch.Tensor, allowed_ids: torch.Tensor):
    """[N, V], [N], [N, K] (-1 padded) -> ([N, K] logits, -inf at padding; [N] target index in K).

    Differentiable in `logits` (gather), so d(logits) lands only on allowed ids.
    """
    allowed = allowed_ids.long()
    valid = allowed >= 0
    sub = logits.gather(1, allowed.clamp(min=0))
    sub = sub.masked_fill(~valid, float("-inf"))
    hit = (allowed == targets.long().unsqueeze(1)) & valid
    if not bool(hit.any(1).all()):
        raise ValueError("a target token is not among its allowed ids: the trajectory and constraint disagree")
    return sub, hit.float().argmax(1)


def _use_triton(logits: torch.Tensor, impl: str) -> bool:
    if impl == "torch":
        return False
    if impl == "triton":
        return True
    return logits.is_cuda


def grpo_loss(
    logits: torch.Tensor,              # [N, V] bf16/fp32 logits at completion positions
    targets: torch.Tensor,             # [N] sampled token ids
    mask: torch.Tensor,                # [N] bool/float, 1 = trained token
    behaviour_logprobs: torch.Tensor,  # [N] float32 sampler log-probs
    advantages: torch.Tensor,          # [N] float32 per-token advantage
    ref_logprobs: torch.Tensor | None = None,  # [N] float32 or None
    *,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 0.0,
    norm: str = "dapo",
    seq_ids: torch.Tensor | None = None,   # [N] sequence index (grpo, dr_grpo)
    num_seqs: int | None = None,
    max_len: int | None = None,
    num_tokens: int | float | None = None,
    allowed_ids: torch.Tensor | None = None,  # [N, K] int, -1 padded
    impl: str = "auto",
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss (differentiable in `logits`) and detached stats: clip_fraction, kl, ratio, num_tokens."""
    weights = token_weights(mask, norm, seq_ids, num_seqs, max_len, num_tokens)
    if allowed_ids is not None:
        logits, targets = restrict_to_allowed(logits, targets, allowed_ids)
        inplace_backward = False  # the gathered copy is ours; writing into it saves nothing
    kwargs = dict(temperature=temperature, eps_low=eps_low, eps_high=eps_high, beta=beta)
    if _use_triton(logits, impl):
        from .triton_grpo import grpo_loss_triton
        return grpo_loss_triton(logits, targets, weights, behaviour_logprobs, advantages, ref_logprobs,
                                inplace_backward=inplace_backward, **kwargs)
    return grpo_loss_reference(logits, targets, weights, behaviour_logprobs, advantages, ref_logprobs, **kwargs)
