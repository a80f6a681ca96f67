"""The per-row scale of d(logits), deferred to the lm_head's input: one fused pass for the objectives
whose per-token coefficient needs every row's log-prob first (GSPO's sequence ratio; TIS and MIS
against the current policy).

Why: for every objective d(logits)_t = c_t * g_t, with g_t = d logp_t / d logits_t =
(onehot(target_t) - p_t) / T and c_t = dL/dlogp_t. For these objectives c_t depends on other rows'
log-probs, so the fused kernel cannot know it while it streams row t; applying it to [N, V] after
the fact costs a second read (and write) of the logits, the kernel's whole cost again. But the
logits are h @ W^T, and with W frozen
    d(h)_t = (c_t g_t) W = c_t (g_t W)
so the scale can wait for d(h) [N, H], about V / H times fewer bytes:
  1. `deferred_loss`: one fused pass writes g_t (unit coefficient) and returns logp_t; the
     objective and c = dL/dlogp run on [N] vectors (`reference.objective_from_logprobs`); c lands
     in the caller's `row_scale` buffer;
  2. `scale_grad_rows` (an identity in forward) on the lm_head's input multiplies d(h) by c in
     backward. It reads the buffer only then, after step 1 filled it.
The caller owes step 2 on a tensor whose rows are the logits' rows one to one, upstream of a map
with no trainable parameter (a trainable W would need the scale inside its own gradient). The
learner does it through `packing.completion_logits(..., grad_row_scale=...)`; the CPU reference
path takes the same route (d(logits) from autograd through the log-softmax), so the learner's
tests exercise it on CPU. Without a row-scale buffer, `grpo_loss` falls back to two passes
(`triton_grpo._two_pass`), exact and slower.
"""
from __future__ import annotations

import torch

from .reference import objective_from_logprobs, per_token_logprobs
from .spec import LossRows, LossSpec

__all__ = ["deferred_loss", "scale_grad_rows", "scale_rows"]


class _ScaleGradRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        if x.numel() // max(x.shape[-1], 1) != scale.numel():  # the rows must be the loss's rows, one to one
            raise ValueError(f"scale_grad_rows: {tuple(x.shape)} has {x.numel() // max(x.shape[-1], 1)} rows, "
                             f"the row scale {scale.numel()}")
        ctx.scale = scale  # a plain attribute, read in backward: the loss fills it after this forward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return scale_rows(grad, ctx.scale), None


def scale_rows(grad: torch.Tensor, scale: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """grad [..., H] with each row times scale [prod(...)] (fp32), as a new tensor of grad's dtype,
    the product in fp32 and rounded once. fused (default: on CUDA): a Triton row kernel."""
    if fused is None:
        fused = grad.is_cuda
    if fused and grad.is_contiguous():
        from .triton_grpo import row_scaled
        return row_scaled(grad.reshape(-1, grad.shape[-1]), scale.reshape(-1)).view_as(grad)
    return torch.mul(grad, scale.reshape(*grad.shape[:-1], 1), out=torch.empty_like(grad))


def scale_grad_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H] unchanged; in backward its gradient's rows times `scale` [prod(...)] (fp32), read then."""
    return _ScaleGradRows.apply(x, scale)


def deferred_loss(
    logits: torch.Tensor,              # [N, V]
    rows: LossRows,
    spec: LossSpec,
    *,
    row_scale: torch.Tensor,           # [N] fp32 out: dL/dlogp per row, owed to the lm_head's input
    fused: bool,                       # the row kernel, else the PyTorch reference
    inplace_backward: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, detached stats), as `grpo_loss`, except that the gradient reaching `logits` is
    d logp / d(logits) on the trained rows, unscaled, and `row_scale` receives the scale."""
    active = (rows.weights > 0).float()
    write_grad = torch.is_grad_enabled() and logits.requires_grad
    if fused:
        from .triton_grpo import unit_pass
        carrier, logp = unit_pass(logits, rows.targets, active, torch.ones_like(active), temperature=spec.temperature,
                                  inplace_backward=inplace_backward, config=config, write_grad=write_grad)
    else:
        logp_graph = per_token_logprobs(logits, rows.targets, spec.temperature)
        logp = logp_graph.detach()
        carrier = ((logp_graph - logp) * active).sum()  # 0, with the gradient d logp / d(logits) on trained rows
    loss, dlogp, stats = objective_from_logprobs(logp, rows, spec, want_dlogp=write_grad)
    if dlogp is not None:
        row_scale.copy_(dlogp)
    return loss + carrier, stats
