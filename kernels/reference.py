"""The PyTorch reference GRPO loss: slow, obviously right, the twin of the Triton kernel.

Per completion token t (rows of `logits`):
    logp_t  = log_softmax(logits_t / temperature)[target_t]
    ratio_t = exp(logp_t - anchor_t)                 token level (the default)
            = exp(mean_{u in seq(t)} (logp_u - anchor_u))   sequence level (GSPO)
    l_t     = -iw_t * min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
              + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)          # k3 KL
    dual clip (`clip_ratio_c` = c > 1, verl's): where A_t < 0 the policy term is
              min(-min(r A, clip(r) A), -c A): a token whose ratio passed c weighs -c A, with no gradient
    loss    = sum_t w_t * keep_t * l_t
with w_t from `token_weights` (the normalization mode). Every implementation receives the same
weights (`spec.LossRows`) and the same `spec.LossSpec`, so the modes live in one place.

Off-policy corrections (`off_policy_weights`; all detached): by default the anchor is the sampler
(behaviour) and iw = keep = 1, the classic GRPO objective. Given the learner's log-probs at the
start of the batch (`old_logprobs`, several updates per batch), or with truncated importance
sampling on (`tis_cap` > 0; the start-of-batch policy is then the current one, detached), the
objective is decoupled (AReaL): the clip is against that policy and iw = exp(old - behaviour),
capped at `tis_cap`, corrects for the sampler apart from the clip. `mis_threshold` > 0 drops
(keep = 0) every sequence whose mean |old - behaviour| exceeds it.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .spec import NORM_MODES, RATIO_LEVELS, LossRows, LossSpec, Objective

__all__ = ["NORM_MODES", "RATIO_LEVELS", "Objective", "token_weights", "per_token_logprobs", "off_policy_weights",
           "objective_terms", "objective_loss", "objective_from_logprobs", "grpo_loss_reference", "token_stats"]


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


def seq_mean(values: torch.Tensor, active: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """[N] -> [N]: each token's mean of `values` over the active tokens of its sequence. Sequence ids
    lie in [0, N) (dense from 0, as packing numbers them), so N slots hold every sequence."""
    seq_ids = seq_ids.long()
    num = seq_ids.numel()  # a bound on the sequence count: no host sync for the max
    sums = torch.zeros(num, dtype=values.dtype, device=values.device).index_add(0, seq_ids, values * active)
    counts = torch.zeros(num, dtype=values.dtype, device=values.device).index_add(0, seq_ids, active)
    # index_select, not [seq_ids]: its backward is a scatter-add, where indexing's sorts the indices first
    return torch.index_select(sums / counts.clamp(min=1.0), 0, seq_ids)


def off_policy_weights(logp, behaviour, weights, seq_ids, old_logprobs, obj: Objective):
    """([N] clip anchor, [N] importance weight, [N] keep mask), all detached (module docstring).
    `logp` is read only when the start-of-batch policy is the current one (no `old_logprobs`)."""
    decoupled = old_logprobs is not None or obj.tis_cap > 0
    learner = None
    if decoupled or obj.mis_threshold > 0:
        learner = (old_logprobs if old_logprobs is not None else logp).detach().float()
    anchor = learner if decoupled else behaviour
    iw = torch.exp(learner - behaviour) if decoupled else torch.ones_like(behaviour)
    if obj.tis_cap > 0:
        iw = iw.clamp(max=obj.tis_cap)
    keep = torch.ones_like(behaviour)
    if obj.mis_threshold > 0:
        if seq_ids is None:
            raise ValueError("mis_threshold needs seq_ids")
        drift = seq_mean((learner - behaviour).abs(), (weights > 0).float(), seq_ids)
        keep = (drift <= obj.mis_threshold).float()
    return anchor, iw, keep


def clipped_surrogate(log_ratio, advantages, eps_low, eps_high, clip_ratio_c: float = 0.0):
    """[N] log-ratios -> (-min(r A, clip(r) A), r, whether a clip holds r). With clip_ratio_c = c > 0
    (dual clip, verl's `compute_policy_loss`): where A < 0 the term is min(that, -c A), so a token
    whose ratio passed c adds the constant -c A and no gradient (counted as clipped)."""
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    is_clipped = ((advantages > 0) & (ratio > 1.0 + eps_high)) | ((advantages < 0) & (ratio < 1.0 - eps_low))
    if clip_ratio_c > 0:
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        is_clipped = is_clipped | dual
    return loss, ratio, is_clipped


def objective_terms(logp: torch.Tensor, rows: LossRows, spec: LossSpec):
    """Per-token terms from [N] log-probs (differentiable in `logp`): (loss_t, effective weights
    w * keep, ratio, kl, is_clipped, importance weight). Shared by the reference and the fused
    path's sequence-level / off-policy objectives, which compute logp with a forward-only kernel."""
    objective, weights, seq_ids = spec.objective, rows.weights, rows.seq_ids
    anchor, iw, keep = off_policy_weights(logp, rows.behaviour_logprobs, weights, seq_ids, rows.old_logprobs,
                                          objective)
    log_ratio = logp - anchor
    if objective.ratio_level == "sequence":
        if seq_ids is None:
            raise ValueError("ratio_level='sequence' needs seq_ids")
        log_ratio = seq_mean(log_ratio, (weights > 0).to(logp.dtype), seq_ids)
    loss, ratio, is_clipped = clipped_surrogate(log_ratio, rows.advantages, spec.eps_low, spec.eps_high,
                                                objective.clip_ratio_c)
    loss = iw * loss
    kl = torch.zeros_like(logp)
    if rows.ref_logprobs is not None and spec.beta > 0:
        delta = rows.ref_logprobs - logp
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + spec.beta * kl
    return loss, weights * keep, ratio, kl, is_clipped, iw


def float_rows(rows: LossRows) -> LossRows:
    """The rows with every float input in float32 (the objective's arithmetic)."""
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    return replace(rows, weights=rows.weights.float(), behaviour_logprobs=rows.behaviour_logprobs.float(),
                   advantages=rows.advantages.float(), ref_logprobs=f32(rows.ref_logprobs),
                   old_logprobs=f32(rows.old_logprobs))


def objective_loss(logp: torch.Tensor, rows: LossRows, spec: LossSpec):
    """[N] log-probs -> (scalar loss, differentiable in `logp`; detached stats): the objective summed
    with its effective weights. The reference's loss and the fused paths' objective on [N] vectors.
    The entropy stat is each trained token's -logp: its expectation under the sampler is the
    entropy, and every path (this one, the fused kernels) has it without another pass over the logits."""
    rows = float_rows(rows)
    loss_t, w_eff, ratio, kl, is_clipped, iw = objective_terms(logp, rows, spec)
    return (w_eff * loss_t).sum(), token_stats(rows.weights, ratio, kl, is_clipped, iw, w_eff, rows.seq_ids,
                                               -logp.detach())


def objective_from_logprobs(logp: torch.Tensor, rows: LossRows, spec: LossSpec, want_dlogp: bool = True):
    """[N] log-probs known before any gradient -> (scalar loss, [N] dL/dlogp or None, stats): the
    objective on [N] vectors (`objective_loss`), for the fused paths whose per-row coefficient
    needs every row's log-prob first. No host sync, so it queues behind the kernel that made `logp`."""
    with torch.enable_grad():
        logp = logp.detach().float().requires_grad_()
        loss, stats = objective_loss(logp, rows, spec)
        dlogp = torch.autograd.grad(loss, logp)[0] if want_dlogp else None
    return loss.detach(), dlogp, stats


def grpo_loss_reference(logits: torch.Tensor, rows: LossRows, spec: LossSpec = LossSpec()):
    """Differentiable reference on [N, V] bf16/fp32 logits: returns (scalar loss, detached stats over
    rows with weight > 0)."""
    return objective_loss(per_token_logprobs(logits, rows.targets, spec.temperature), rows, spec)


def token_stats(weights, ratio, kl, is_clipped, iw=None, w_eff=None, seq_ids=None,
                entropy=None) -> dict[str, torch.Tensor]:
    """Means over the trained tokens (effective weight w * keep > 0), detached; `is_weight` is the
    mean importance weight against the sampler (1 unless decoupled), `mis_masked_seqs` the
    sequences the off-policy mask dropped, `ratio_max` the largest ratio, `entropy` the mean of the
    given [N] sampled tokens' -logp (on the sampler's own tokens, an unbiased estimate of the entropy)."""
    active = ((weights if w_eff is None else w_eff) > 0).float()
    n = active.sum().clamp(min=1.0)
    masked = torch.zeros((), device=weights.device)
    if w_eff is not None and seq_ids is not None and seq_ids.numel():
        dropped = (weights > 0).float() * (w_eff <= 0).float()
        per_seq = torch.zeros(seq_ids.numel(), device=weights.device).index_add(0, seq_ids.long(), dropped)
        masked = (per_seq > 0).float().sum()
    return {
        "clip_fraction": (is_clipped.float() * active).sum().detach() / n,
        "kl": (kl.float() * active).sum().detach() / n,
        "ratio": (ratio.float() * active).sum().detach() / n,
        "num_tokens": active.sum().detach(),
        "is_weight": ((iw.float() if iw is not None else torch.ones_like(active)) * active).sum().detach() / n,
        "mis_masked_seqs": masked.detach(),
        "ratio_max": torch.where(active > 0, ratio.float(), torch.zeros_like(active)).max().detach()
        if active.numel() else torch.zeros((), device=weights.device),
        "entropy": ((entropy.float() if entropy is not None else torch.zeros_like(active)) * active).sum().detach() / n,
    }
