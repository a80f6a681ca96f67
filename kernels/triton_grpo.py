"""The fused GRPO loss as an autograd Function: `grpo_loss_triton`, the twin of `reference.grpo_loss_reference`.

Role: `colocate.kernels.grpo_loss` dispatches here on CUDA (and tests, on CPU, under the Triton
interpreter). The forward call runs the row kernel (`triton_rows.grpo_rows`), which computes the
loss terms and d(logits) in one pass over the logits; backward only scales that stored gradient by
grad_output, on the device and not at all when it is 1 (no host sync).

Left out on purpose: sequence-level importance ratios (GSPO), CISPO/SAPO variants, the delta
clamp, and dL/d(behaviour, advantages, ref) (all are data, not parameters).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_rows import ACTIVE, CLIPPED, KL, LOSS, RATIO, grpo_rows

__all__ = ["grpo_loss_triton", "stats_from_rows", "scale_stored_grad"]


def stats_from_rows(row_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """[N, 5] per-row outputs -> (loss, stats); stats are means over rows with weight > 0."""
    sums = row_out.sum(0)  # one reduction for all five columns
    num_tokens = sums[ACTIVE]
    means = sums / num_tokens.clamp(min=1.0)
    return sums[LOSS], {"clip_fraction": means[CLIPPED], "kl": means[KL], "ratio": means[RATIO],
                         "num_tokens": num_tokens}


@triton.jit
def _scale_rows_kernel(grad_ptr, scale_ptr, num_rows, num_cols, stride_row, BLOCK: tl.constexpr):
    """grad[r, :] *= scale, unless scale == 1: then every program returns after one scalar load."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        cols = tl.arange(0, BLOCK)
        for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
            ptr = grad_ptr + tl.cast(row, tl.int64) * stride_row
            for start in range(0, num_cols, BLOCK):
                g = tl.load(ptr + start + cols, mask=start + cols < num_cols)
                tl.store(ptr + start + cols, (g.to(tl.float32) * scale).to(g.dtype), mask=start + cols < num_cols)


def scale_stored_grad(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """grad * grad_output in place, free in the usual case grad_output == 1 (loss.backward()).

    The test for 1 happens on the device, so there is no host sync; multiplying unconditionally
    would cost a full read and write of [N, V], as much as the whole loss kernel.
    """
    rows = grad.reshape(-1, grad.shape[-1]) if grad.is_contiguous() else grad  # [N, V] or [N, H]
    if rows.dim() == 2 and rows.stride(1) == 1 and rows.numel() > 0:
        num_programs = 4 * torch.cuda.get_device_properties(rows.device).multi_processor_count \
            if rows.is_cuda else 4
        _scale_rows_kernel[(min(rows.shape[0], num_programs),)](
            rows, grad_output.reshape(1).float(), rows.shape[0], rows.shape[1], rows.stride(0), BLOCK=2048)
    elif rows.numel() > 0:
        grad.mul_(grad_output.to(grad.dtype))
    # detach(): a fresh tensor object over the same storage, so autograd can take it as .grad
    # without a copy (in place, `grad` is the caller's logits tensor and is referenced elsewhere).
    return grad.detach()


class _GRPOLossTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, weights, behaviour_logprobs, advantages, ref_logprobs,
                temperature, eps_low, eps_high, beta, inplace_backward, config, write_grad):
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        grad = None
        if write_grad:
            grad = logits if inplace_backward else torch.empty_like(logits)
        row_out = grpo_rows(logits, targets, weights, behaviour_logprobs, advantages, ref_logprobs, grad,
                            temperature=temperature, eps_low=eps_low, eps_high=eps_high, beta=beta, config=config)
        ctx.grad = grad  # a plain attribute: in place, it is the (overwritten) input itself
        ctx.mark_non_differentiable(row_out)
        loss = row_out[:, LOSS].sum()
        return loss, row_out

    @staticmethod
    def backward(ctx, grad_loss, _grad_row_out):
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("grpo_loss_triton: backward through the same call twice is not supported "
                               "(the gradient was computed once, in forward)")
        return (scale_stored_grad(grad, grad_loss),) + (None,) * 12


def grpo_loss_triton(
    logits: torch.Tensor,              # [N, V] bf16/fp32 (CUDA, or CPU under TRITON_INTERPRET=1)
    targets: torch.Tensor,             # [N] int
    weights: torch.Tensor,             # [N] fp32 = mask * normalization (token_weights), >= 0
    behaviour_logprobs: torch.Tensor,  # [N] fp32
    advantages: torch.Tensor,          # [N] fp32
    ref_logprobs: torch.Tensor | None = None,  # [N] fp32
    *,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 0.0,
    inplace_backward: bool = False,
    config: dict | None = None,        # launch overrides: block_v, num_warps, programs_per_sm, num_programs
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, detached stats), differentiable in `logits`; matches `grpo_loss_reference`.

    The gradient is computed in the forward call. With `inplace_backward=True` it overwrites
    `logits` there and then (as Liger does): the logits are garbage after this call, so nothing
    else may read them (including an autograd op that saved them), and the returned loss is
    only a value. Backward through one call once.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    loss_sum, row_out = _GRPOLossTriton.apply(
        logits, targets, weights, behaviour_logprobs, advantages, ref_logprobs,
        float(temperature), float(eps_low), float(eps_high), float(beta), bool(inplace_backward), config,
        # Decided here: inside forward grad mode is off and needs_input_grad ignores torch.no_grad().
        torch.is_grad_enabled() and logits.requires_grad)
    _, stats = stats_from_rows(row_out)
    return loss_sum, {k: v.detach() for k, v in stats.items()}
