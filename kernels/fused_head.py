"""GRPO loss from hidden states and a frozen lm_head, without storing the [N, V] logits.

Role: the memory mode of the Triton loss. Rows are taken a chunk at a time: the chunk's logits
are one GEMM ([C, H] @ [H, V]), the Triton row kernel turns them into d(logits) in place, and a
second GEMM gives d(hidden) for the chunk ([C, V] @ [V, H]). Peak memory is one [C, V] buffer
plus d(hidden) [N, H]; everything happens in the forward call, backward only scales d(hidden).

Left out on purpose: d(lm_head weight). LoRA freezes the head, so the call refuses a weight that
requires grad rather than silently dropping its gradient. The head GEMMs run once each (2·N·H·V
FLOPs twice), not three times as a recompute-in-backward design would.
"""
from __future__ import annotations

import torch

from colocate.kernels.triton_grpo import grpo_rows, scale_stored_grad, stats_from_rows

__all__ = ["grpo_loss_from_hidden"]


class _GRPOLossFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, lm_head_weight, targets, weights, behaviour_logprobs, advantages, ref_logprobs,
                chunk_size, temperature, eps_low, eps_high, beta, config, write_grad):
        num_rows, vocab = hidden.shape[0], lm_head_weight.shape[0]
        # Masked rows cost nothing: only rows with weight > 0 go through the head (one host sync).
        active = torch.nonzero(weights > 0).squeeze(1)                               # [Na]
        rows_kw = dict(temperature=temperature, eps_low=eps_low, eps_high=eps_high, beta=beta, config=config)
        row_out = torch.zeros(num_rows, 5, dtype=torch.float32, device=hidden.device)  # masked rows: zeros
        grad_hidden = torch.zeros_like(hidden) if write_grad else None               # [N, H]
        buf = hidden.new_empty(min(chunk_size, max(active.numel(), 1)), vocab)      # [C, V], reused
        for start in range(0, active.numel(), chunk_size):
            idx = active[start:start + chunk_size]                                   # [c]
            logits = torch.mm(hidden.index_select(0, idx), lm_head_weight.t(), out=buf[: idx.numel()])
            ref = None if ref_logprobs is None else ref_logprobs[idx]
            row_out[idx] = grpo_rows(logits, targets[idx], weights[idx], behaviour_logprobs[idx], advantages[idx],
                                     ref, logits if write_grad else None, **rows_kw)
            if write_grad:  # logits now hold d(logits)
                grad_hidden.index_copy_(0, idx, torch.mm(logits, lm_head_weight))
        ctx.grad_hidden = grad_hidden
        ctx.mark_non_differentiable(row_out)
        return row_out[:, 0].sum(), row_out

    @staticmethod
    def backward(ctx, grad_loss, _grad_row_out):
        grad, ctx.grad_hidden = ctx.grad_hidden, None
        if grad is None:
            raise RuntimeError("grpo_loss_from_hidden: backward through the same call twice is not supported")
        return (scale_stored_grad(grad, grad_loss),) + (None,) * 13


def grpo_loss_from_hidden(
    hidden: torch.Tensor,              # [N, H] bf16/fp32 final hidden states at completion positions
    lm_head_weight: torch.Tensor,      # [V, H] same dtype, frozen (requires_grad False)
    targets: torch.Tensor,             # [N] int
    weights: torch.Tensor,             # [N] fp32 = mask * normalization (token_weights), >= 0
    behaviour_logprobs: torch.Tensor,  # [N] fp32
    advantages: torch.Tensor,          # [N] fp32
    ref_logprobs: torch.Tensor | None = None,  # [N] fp32
    *,
    chunk_size: int = 4096,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 0.0,
    config: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, detached stats), differentiable in `hidden`; equals
    `grpo_loss_triton(hidden @ lm_head_weight.T, ...)` with chunk_size rows of logits alive at once."""
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(f"need hidden [N, H] and lm_head_weight [V, H], got {tuple(hidden.shape)}, "
                         f"{tuple(lm_head_weight.shape)}")
    if lm_head_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("grpo_loss_from_hidden computes no lm_head gradient: freeze the head "
                         "(requires_grad_(False)) or use grpo_loss on materialized logits")
    loss, row_out = _GRPOLossFromHidden.apply(
        hidden, lm_head_weight, targets, weights, behaviour_logprobs, advantages, ref_logprobs,
        int(chunk_size), float(temperature), float(eps_low), float(eps_high), float(beta), config,
        torch.is_grad_enabled() and hidden.requires_grad)
    _, stats = stats_from_rows(row_out)
    return loss, {k: v.detach() for k, v in stats.items()}
