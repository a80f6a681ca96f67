"""GRPO loss: one entry (`grpo_loss`), a Triton kernel on CUDA and a PyTorch reference elsewhere.

The learner calls only `grpo_loss`, with one call's tensors (`spec.LossBatch`) and the run's
`spec.LossSpec`. It
  1. restricts the vocabulary to the constraint's allowed ids when given (the sampler's mask), by
     gathering those logits into a small [N, K] problem: the same masked log-softmax the engine
     sampled from, at a fraction of the cost;
  2. turns the normalization mode into per-token weights (`token_weights`);
  3. takes the policy objective (`spec.Objective`: token or sequence ratio, truncated and
     masked importance sampling) and, with several updates per batch, the learner's log-probs at
     the start of the batch (`old_logprobs`, from `token_logprobs`);
  4. given a `row_scale` buffer, takes the objectives that need every row's log-prob first in one
     fused pass and leaves their per-row scale to the caller's lm_head input (`deferred`);
  5. dispatches to the fused kernel (CUDA, `impl` auto/triton: `triton_grpo`, whose row launch
     `triton_rows` runs the bulk-copy CUDA row kernel `cuda_grpo` on sm_90 with bf16 logits) or the
     reference (`impl` torch).

This package imports nothing from the rest of colocate (it is installed as `colocate.kernels` but
stands alone); Triton is imported only when the fused kernel runs.
"""
from __future__ import annotations

import torch

from .deferred import deferred_loss, scale_grad_rows
from .reference import grpo_loss_reference, per_token_logprobs, token_weights
from .spec import NORM_MODES, RATIO_LEVELS, LossBatch, LossRows, LossSpec, Objective

__all__ = ["grpo_loss", "grpo_loss_reference", "token_logprobs", "token_weights", "NORM_MODES", "RATIO_LEVELS",
           "Objective", "LossSpec", "LossBatch", "LossRows", "restrict_to_allowed", "scale_grad_rows"]


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
    batch: LossBatch,
    spec: LossSpec = LossSpec(),
    *,
    inplace_backward: bool = False,
    row_scale: torch.Tensor | None = None,  # [N] fp32 out: see `deferred` (the caller scales d(lm_head input))
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss (differentiable in `logits`) and detached stats: clip_fraction, kl, ratio,
    num_tokens, is_weight, mis_masked_seqs. With `row_scale`, the gradient reaching `logits` lacks
    its per-row scale, which lands in `row_scale` for the caller to apply (`deferred`)."""
    weights = token_weights(batch.mask, spec.norm, batch.seq_ids, batch.num_seqs, spec.max_len, batch.num_tokens)
    targets = batch.targets
    if batch.allowed_ids is not None:
        logits, targets = restrict_to_allowed(logits, targets, batch.allowed_ids)
        inplace_backward = False  # the gathered copy is ours; writing into it saves nothing
    rows = LossRows(targets, weights, batch.behaviour_logprobs, batch.advantages, batch.ref_logprobs, batch.seq_ids,
                    batch.old_logprobs)
    fused = _use_triton(logits, spec.impl)
    if row_scale is not None:
        return deferred_loss(logits, rows, spec, row_scale=row_scale, fused=fused, inplace_backward=inplace_backward)
    if fused:
        from .triton_grpo import grpo_loss_triton
        return grpo_loss_triton(logits, rows, spec, inplace_backward=inplace_backward)
    return grpo_loss_reference(logits, rows, spec)


def token_logprobs(
    logits: torch.Tensor,              # [N, V] bf16/fp32
    targets: torch.Tensor,             # [N]
    *,
    temperature: float = 1.0,
    allowed_ids: torch.Tensor | None = None,  # [N, K] int, -1 padded
    impl: str = "auto",
) -> torch.Tensor:                     # [N] float32, no gradient
    """Log-probs of the targets under the same temperature and mask as `grpo_loss`: the row
    kernel's forward-only pass on CUDA (no float32 [N, V]), the reference elsewhere."""
    if allowed_ids is not None:
        logits, targets = restrict_to_allowed(logits, targets, allowed_ids)
    logits = logits.detach()
    if not _use_triton(logits, impl):
        return per_token_logprobs(logits, targets, temperature)
    from .triton_rows import LOGP, grpo_rows
    ones = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    rows = grpo_rows(x, targets, ones, ones, ones, None, None, temperature=temperature, eps_low=0.2, eps_high=0.28,
                     beta=0.0)
    return rows[:, LOGP].clone()
