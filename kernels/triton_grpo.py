"""The fused GRPO loss as an autograd Function: `grpo_loss_triton`, the twin of `reference.grpo_loss_reference`.

Role: `colocate.kernels.grpo_loss` dispatches here on CUDA (and tests, on CPU, under the Triton
interpreter). The forward call runs the row kernel (`triton_rows.grpo_rows`), which computes the
loss terms and d(logits) in one pass over the logits; backward only scales that stored gradient by
grad_output, on the device and not at all when it is 1 (no host sync).

Objectives beyond GRPO (`spec.Objective`, off-policy corrections) keep the kernel's memory
behaviour. Each needs only per-row inputs, since d(logits)_t = dL/dlogp_t * (onehot - p_t) / T:
  * a start-of-batch policy given (`old_logprobs`) with a token ratio: the clip anchor, importance
    weight and sequence mask are [N] data known before the kernel, so the one fused pass runs with
    behaviour := anchor, advantages := A * iw and weights := w * keep (`_fold_off_policy`);
  * a sequence-level ratio (GSPO), or TIS / MIS against the current policy, need every row's
    log-prob before any gradient. With a row-scale buffer from the caller, one fused pass writes
    d logp / d(logits) and the scale waits for the lm_head's input (`deferred`, what the learner
    runs). Without one (`_two_pass`): a forward-only pass of the row kernel gives logp [N], the
    objective and dL/dlogp are computed in PyTorch on [N] vectors (`reference.objective_from_logprobs`,
    the reference's own code), and a second pass writes d(logits) from that per-row coefficient
    (`unit_pass`). No [N, V] temporary either way.
Left out on purpose: CISPO/SAPO variants, the delta clamp, and dL/d(behaviour, advantages, ref)
(all are data, not parameters).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .reference import objective_from_logprobs, off_policy_weights, token_stats
from .spec import LossRows, LossSpec, Objective
from .triton_rows import ACTIVE, CLIPPED, KL, LOGP, LOSS, RATIO, grpo_rows

__all__ = ["grpo_loss_triton", "stats_from_rows", "scale_stored_grad", "unit_pass", "row_scaled"]


def stats_from_rows(row_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """[N, 6] per-row outputs -> (loss, stats); stats are means over rows with weight > 0 (the
    off-policy ones of plain GRPO: importance weight 1, nothing masked). The entropy is the
    sampled tokens' mean -logp, from the column the kernel already writes, as on every path
    (`reference.objective_loss`)."""
    sums = row_out.sum(0)  # one reduction for all columns
    num_tokens = sums[ACTIVE]
    means = sums / num_tokens.clamp(min=1.0)
    neg_logp = -(row_out[:, LOGP] * row_out[:, ACTIVE]).sum() / num_tokens.clamp(min=1.0)
    return sums[LOSS], {"clip_fraction": means[CLIPPED], "kl": means[KL], "ratio": means[RATIO],
                         "num_tokens": num_tokens, "is_weight": (num_tokens > 0).float(),
                         "mis_masked_seqs": torch.zeros_like(num_tokens),
                         "ratio_max": (row_out[:, RATIO] * row_out[:, ACTIVE]).max(), "entropy": neg_logp}


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


@triton.jit
def _row_scaled_kernel(grad_ptr, scale_ptr, out_ptr, num_cols, stride_grad, stride_out, BLOCK: tl.constexpr):
    """out[r, :] = grad[r, :] * scale[r], the product in fp32 (one program per row)."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr + row).to(tl.float32)
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        g = tl.load(grad_ptr + row * stride_grad + cols, mask=cols < num_cols)
        tl.store(out_ptr + row * stride_out + cols, (g.to(tl.float32) * scale).to(out_ptr.dtype.element_ty),
                 mask=cols < num_cols)


def row_scaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[R, C] (unit column stride) * [R] fp32 -> a new [R, C] of grad's dtype: `deferred.scale_rows` on
    CUDA, one read and one write (torch's broadcast multiply across dtypes streams far slower)."""
    out = torch.empty_like(grad)
    if grad.numel():
        _row_scaled_kernel[(grad.shape[0],)](grad, scale.float().contiguous(), out, grad.shape[1], grad.stride(0),
                                             out.stride(0), BLOCK=min(4096, triton.next_power_of_2(grad.shape[1])))
    return out


class _GRPOLossTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows: LossRows, spec: LossSpec, inplace_backward, config, write_grad, dlogp):
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        grad = None
        if write_grad:
            grad = logits if inplace_backward else torch.empty_like(logits)
        row_out = grpo_rows(logits, rows.targets, rows.weights, rows.behaviour_logprobs, rows.advantages,
                            rows.ref_logprobs, grad, dlogp, temperature=float(spec.temperature),
                            eps_low=float(spec.eps_low), eps_high=float(spec.eps_high), beta=float(spec.beta),
                            config=config)
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
        return (scale_stored_grad(grad, grad_loss),) + (None,) * 6


def _fold_off_policy(rows: LossRows, objective: Objective):
    """Token ratio with a known start-of-batch policy: (rows with weights * keep, the anchor as
    behaviour and A * iw as advantages; stats inputs). iw > 0, so -min(r A iw, clip(r) A iw) = iw *
    GRPO's term."""
    weights = rows.weights
    anchor, iw, keep = off_policy_weights(None, rows.behaviour_logprobs.float(), weights, rows.seq_ids,
                                          rows.old_logprobs, objective)
    folded = replace(rows, weights=weights * keep, behaviour_logprobs=anchor, advantages=rows.advantages.float() * iw)
    return folded, (iw, weights, weights * keep)


def _two_pass(logits, rows: LossRows, spec: LossSpec, *, inplace_backward, config):
    """Objectives whose coefficients need every row's log-prob first, when the caller cannot take
    the row scale downstream (`deferred`; module docstring) -> (loss, stats)."""
    write_grad = torch.is_grad_enabled() and logits.requires_grad
    x = logits.detach() if logits.stride(1) == 1 else logits.detach().contiguous()
    active = (rows.weights > 0).float()
    out = grpo_rows(x, rows.targets, active, rows.behaviour_logprobs, rows.advantages, None, None,
                    temperature=float(spec.temperature), eps_low=float(spec.eps_low), eps_high=float(spec.eps_high),
                    beta=0.0, config=config)  # forward only: logp
    loss, dlogp, stats = objective_from_logprobs(out[:, LOGP], rows, spec, want_dlogp=write_grad)
    if not write_grad:
        return loss, stats
    # Rows whose coefficient is 0 (masked, or clipped) are not read: the kernel writes their zeros.
    return loss + unit_pass(logits, rows.targets, (dlogp != 0).float(), dlogp, temperature=spec.temperature,
                            inplace_backward=inplace_backward, config=config, write_grad=True)[0], stats


def unit_pass(logits, targets, weights, coefficient, *, temperature, inplace_backward, config, write_grad):
    """One fused pass whose stored gradient is weights * coefficient * d logp / d(logits) per row
    -> (a loss of exactly 0 that carries that gradient into autograd, [N] log-probs). Zero behaviour
    and advantages make the kernel's own loss terms 0."""
    zeros = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    spec = LossSpec(eps_low=0.0, eps_high=0.0, beta=0.0, temperature=float(temperature))
    zero_loss, row_out = _GRPOLossTriton.apply(logits, LossRows(targets, weights, zeros, zeros), spec,
                                               bool(inplace_backward), config, write_grad, coefficient)
    return zero_loss, row_out[:, LOGP]


def grpo_loss_triton(
    logits: torch.Tensor,              # [N, V] bf16/fp32 (CUDA, or CPU under TRITON_INTERPRET=1)
    rows: LossRows,
    spec: LossSpec = LossSpec(),
    *,
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
    objective = spec.objective
    if objective.needs_logprobs_first(rows.old_logprobs is not None):
        return _two_pass(logits, rows, spec, inplace_backward=inplace_backward, config=config)
    folded = None
    if rows.old_logprobs is not None or objective != Objective():
        rows, folded = _fold_off_policy(rows, objective)
    loss_sum, row_out = _GRPOLossTriton.apply(
        logits, rows, spec, bool(inplace_backward), config,
        # Decided here: inside forward grad mode is off and needs_input_grad ignores torch.no_grad().
        torch.is_grad_enabled() and logits.requires_grad, None)
    _, stats = stats_from_rows(row_out)
    if folded is not None:  # the importance weight and mask, over the rows the caller trains
        stats = _folded_stats(row_out, *folded, rows.seq_ids)
    return loss_sum, {k: v.detach() for k, v in stats.items()}


def _folded_stats(row_out, iw, weights, w_eff, seq_ids):
    """Stats of a folded off-policy call, as `reference.token_stats` (the kernel skipped masked rows)."""
    return token_stats(weights, row_out[:, RATIO], row_out[:, KL], row_out[:, CLIPPED] > 0, iw, w_eff, seq_ids,
                       -row_out[:, LOGP])
