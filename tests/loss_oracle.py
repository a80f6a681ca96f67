"""The one float64 oracle of the loss, for every loss and kernel test: the objective written out
from its definitions (GRPO's clip, verl's dual clip, GSPO's sequence ratio, AReaL's decoupled clip,
truncated and masked importance sampling, the k3 KL) and the normalization modes, with no code
shared with `colocate.kernels`. It takes what production takes: the rows (`kernels.spec.LossRows`:
targets, weights, behaviour, advantages, reference, sequence ids, start-of-batch log-probs) and the
run's `LossSpec` (temperature, clip range, beta, `Objective`); `norm_weights` turns a mask into the
weights of a norm mode. Imported by the Triton interpreter's subprocess too, so it imports nothing
of colocate (a `LossRows` / `LossSpec` is read by attribute).
"""
from dataclasses import dataclass

import torch


@dataclass
class Float64Loss:
    loss: torch.Tensor    # the loss, a float64 scalar
    grad: torch.Tensor    # d loss / d logits [N, V], float64
    scale: torch.Tensor   # sum_t |w_t l_t|: what a loss that cancels to near zero is compared against
    stats: dict           # clip_fraction, kl, ratio (token ratio), num_tokens over the trained tokens


def norm_weights(mask, seq_ids, spec) -> torch.Tensor:
    """[N] float64 weights = mask * the norm mode's normalization: grpo 1 / (sequences * the
    token's sequence length), dapo 1 / trained tokens, dr_grpo 1 / (sequences * max_len); the
    sequences are 0..max(seq_ids)."""
    m = mask.double()
    seq = seq_ids.long()
    num_seqs = int(seq.max()) + 1
    if spec.norm == "dapo":
        return m / m.sum()
    if spec.norm == "dr_grpo":
        return m / (num_seqs * spec.max_len)
    lengths = torch.zeros(num_seqs, dtype=torch.float64, device=m.device).index_add_(0, seq, m)
    return m / (num_seqs * lengths[seq].clamp(min=1))


def per_sequence_mean(values, seq, active) -> torch.Tensor:
    """Each token's sequence's mean of `values` over its trained tokens."""
    n = int(seq.max()) + 1 if seq.numel() else 1
    zeros = torch.zeros(n, dtype=torch.float64, device=values.device)
    count = zeros.index_add(0, seq, active.double())
    total = zeros.index_add(0, seq, torch.where(active, values, torch.zeros_like(values)))
    return (total / count.clamp(min=1))[seq]


def loss_float64(logits, rows, spec) -> Float64Loss:
    """The loss of `rows` (a `LossRows`) under `spec` (a `LossSpec`) on `logits` [N, V] (any dtype,
    upcast): sum_t w_t * (iw_t * policy_t + beta * k3_t) over the trained tokens of kept sequences."""
    objective = spec.objective
    x = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(x / spec.temperature, -1).gather(1, rows.targets.long()[:, None]).squeeze(1)
    b, adv, w = rows.behaviour_logprobs.double(), rows.advantages.double(), rows.weights.double()
    active = w > 0
    seq = rows.seq_ids.long() if rows.seq_ids is not None else torch.zeros_like(rows.targets, dtype=torch.long)
    old = rows.old_logprobs
    learner = old.double() if old is not None else logp.detach()
    decoupled = old is not None or objective.tis_cap > 0
    # the ratio's anchor: the sampler, or (decoupled) the learner at the start of the batch
    log_ratio = logp - (learner if decoupled else b)
    token_ratio = torch.exp(log_ratio)
    if objective.ratio_level == "sequence":  # GSPO: the geometric mean of the sequence's token ratios
        log_ratio = per_sequence_mean(log_ratio, seq, active)
    r = torch.exp(log_ratio)
    iw = torch.exp(learner - b) if decoupled else torch.ones_like(r)
    if objective.tis_cap > 0:
        iw = torch.clamp(iw, max=objective.tis_cap)
    # verl's compute_policy_loss: max(-A r, -A clip(r)); with the dual clip, where A < 0, min(-A c, that)
    policy = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - spec.eps_low, 1 + spec.eps_high))
    if objective.clip_ratio_c > 0:
        policy = torch.where(adv < 0, torch.minimum(-adv * objective.clip_ratio_c, policy), policy)
    kl = torch.zeros_like(logp)
    if rows.ref_logprobs is not None and spec.beta > 0:
        d = rows.ref_logprobs.double() - logp
        kl = torch.exp(d) - d - 1
    term = iw * policy + spec.beta * kl
    kept = active
    if objective.mis_threshold > 0:  # a sequence that drifted from the sampler is masked whole
        kept = active & (per_sequence_mean((learner - b).abs(), seq, active) <= objective.mis_threshold)
    weighted = torch.where(kept, w * term, torch.zeros_like(term))
    loss = weighted.sum()
    loss.backward()
    n = active.sum().clamp(min=1)
    clipped = ((adv > 0) & (token_ratio > 1 + spec.eps_high)) | ((adv < 0) & (token_ratio < 1 - spec.eps_low))
    stats = {"clip_fraction": (clipped & active).sum() / n, "kl": (kl.detach() * active).sum() / n,
             "ratio": (token_ratio.detach() * active).sum() / n, "num_tokens": active.sum().double()}
    return Float64Loss(loss.detach(), x.grad, weighted.detach().abs().sum(), stats)


def objective_inputs(num_rows, vocab, dtype, *, seed, temperature=1.0, num_seqs=5):
    """Random inputs for the objectives: sequences of several tokens, 20% masked rows, sampler
    log-probs spread around the true ones (some sequences drift further, for the mask), a
    start-of-batch policy between the two."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (num_rows,), generator=g)
    seq_ids = torch.sort(torch.randint(0, num_seqs, (num_rows,), generator=g)).values
    mask = (torch.rand(num_rows, generator=g) > 0.2).float()
    exact = torch.log_softmax(logits.double() / temperature, -1).gather(1, targets[:, None]).squeeze(1)
    drift = 0.05 + 0.5 * (seq_ids % 2).double()  # odd sequences drift ~10x more from the sampler
    behaviour = (exact + drift * torch.randn(num_rows, generator=g, dtype=torch.float64)).float()
    old = (exact + 0.02 * torch.randn(num_rows, generator=g, dtype=torch.float64)).float()
    advantages = torch.randn(num_seqs, generator=g)[seq_ids]
    ref = (exact + 0.2 * torch.randn(num_rows, generator=g, dtype=torch.float64)).float()
    return dict(logits=logits, targets=targets, weights=mask / mask.sum().clamp(min=1), behaviour=behaviour,
                advantages=advantages, ref=ref, seq_ids=seq_ids, old=old)
