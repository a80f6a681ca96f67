"""One learner rank's forward and backward passes over its micro-batches (`Learner._update` runs
them, `forward_backward`), and its no-grad passes: the log-probs at the start of the step
(`start_logprobs`) and under the adapter-disabled model (`reference_logprobs`).

Per micro-batch (`micro_batch_step`): (beta > 0) an adapter-disabled no-grad pass for reference
log-probs -> policy forward, logits at completion positions only -> `colocate.kernels.grpo_loss` ->
backward (FSDP reduce-scatters the adapter gradients after every micro-batch, in fp32, into fp32
shards: the adapter is ~0.5 % of the model, and deferring the sync would accumulate in bf16). Every
rank runs as many micro-batches as the busiest one (FSDP's collectives must match; the extra ones
are 2-token dummies with zero loss). The canary's probe, riding a micro-batch's inputs, is scored
on the way (`Learner.probe_scored`).

Each function takes the `Learner` and reads what it holds at the call (model, loss spec, device,
attention, config): benchmarks point one learner at other layouts between calls."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import record_function

from colocate.data import TrajectoryBatch
from colocate.kernels import LossBatch, grpo_loss, restrict_to_allowed, token_logprobs
from colocate.kernels.reference import per_token_logprobs
from colocate.learner.packing import MicroBatch, dummy_micro_batch, layout
from colocate.learner.packing import completion_logits as micro_batch_logits
from colocate.learner.stats import MICRO_BATCH_STATS


def lm_head_frozen(model) -> bool:
    """Whether no lm_head parameter trains: then GSPO and TIS/MIS against the current policy take one
    fused loss pass, their per-row scale applied at the lm_head's input (`kernels.deferred`)."""
    return not any(p.requires_grad for p in model.get_output_embeddings().parameters())


def probe_terms(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The canary's reference from the probe's [R, V] logits and [R] targets: float32 log-probs at
    temperature 1, no mask, and the logits' RMS (the bound's scale, 0-dim), detached, on their device."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    return logp.detach(), logits.detach().pow(2).mean().sqrt()


@dataclass(frozen=True)
class Passes:
    """One rank's forward/backward passes of an update (`forward_backward`), on the device."""
    sums: torch.Tensor        # [MICRO_BATCH_STATS] summed over the passes
    ratio_max: torch.Tensor   # [] the largest ratio over them
    model_tokens: int         # tokens the model ran


@torch.no_grad()
def reference_logprobs(learner: "Learner", mb: MicroBatch, allowed: torch.Tensor | None) -> torch.Tensor:
    """[N] log-probs of the adapter-disabled model (same temperature and constraint mask)."""
    with learner.model.disable_adapter():
        logits = micro_batch_logits(learner.model, mb)
    targets = mb.targets
    if allowed is not None:
        logits, targets = restrict_to_allowed(logits, targets, allowed)
    return per_token_logprobs(logits, targets, learner.spec.temperature)


@torch.no_grad()
def start_logprobs(learner: "Learner", batch: TrajectoryBatch) -> torch.Tensor:
    """[N] log-probs of every completion token under the current adapter, in batch order (the
    policy at the start of the step), from the loss kernel's forward-only pass, in the step's own
    layout (packed or prefix trees: their rows map back to the batch by sequence). FSDP: every
    rank runs as many forwards as the busiest one."""
    lc, device, spec = learner.cfg.learner, learner.device, learner.spec
    work = layout(batch, lc.micro_batch_tokens, lc.prefix_sharing, device, learner.attention)
    num_micro = learner.num_micro_batches(len(work))  # FSDP: all-reduce (max)
    comp_lens = batch.completion_lens.tolist()
    starts = (torch.cumsum(batch.completion_lens, 0) - batch.completion_lens).tolist()
    out = torch.zeros(batch.num_completion_tokens, dtype=torch.float32)
    learner.model.train()  # the mode the loss's forward runs in
    for i in range(num_micro):
        if i >= len(work):
            micro_batch_logits(learner.model, dummy_micro_batch(device, learner.attention))
            continue
        group, sub, mb = work[i]
        allowed = sub.allowed_ids.to(device) if sub.allowed_ids is not None else None
        logp = token_logprobs(micro_batch_logits(learner.model, mb), mb.targets,
                              temperature=spec.temperature, allowed_ids=allowed, impl=spec.impl)
        rows = torch.cat([torch.arange(starts[j], starts[j] + comp_lens[j]) for j in group])
        out[rows] = logp.float().cpu()
    return out


def forward_backward(learner: "Learner", work: list[tuple[TrajectoryBatch, MicroBatch]], num_micro: int,
                     num_seqs: int, num_tokens: float, rider: list[int] | None = None) -> Passes:
    """`num_micro` passes (dummies past this rank's own) -> their stats, on the device. `rider`:
    what the first pass carries when it is a dummy (`work`'s first micro-batch already does)."""
    learner.model.train()
    totals = torch.zeros(len(MICRO_BATCH_STATS), device=learner.device)
    ratio_max = torch.zeros((), device=learner.device)
    model_tokens = 0
    for i in range(num_micro):
        with record_function("learner/micro_batch"):
            one = micro_batch_step(learner, work[i] if i < len(work) else None, num_seqs, num_tokens,
                                   rider if i == 0 else None)
        if one is not None:
            totals += one.sums
            ratio_max = torch.maximum(ratio_max, one.ratio_max)
            model_tokens += one.model_tokens
    return Passes(totals, ratio_max, model_tokens)


def micro_batch_step(learner: "Learner", item: tuple[TrajectoryBatch, MicroBatch] | None, num_seqs: int,
                     num_tokens: float, rider: list[int] | None = None) -> Passes | None:
    """Forward, loss and backward of one micro-batch (None: a 2-token dummy with zero loss, so this
    rank runs as many passes as the busiest one, carrying `rider`) -> its stats on the device (None
    for a dummy). A rider in the inputs is scored on the way (`probe_scored`). Nothing here reads
    a value back to the host, so the host queues the next micro-batch while the GPU runs this one."""
    device, spec = learner.device, learner.spec
    if item is None:
        logits = training_logits(learner, dummy_micro_batch(device, learner.attention, rider))
        (logits.sum() * 0.0).backward()
        return None
    sub, mb = item
    allowed = sub.allowed_ids.to(device) if sub.allowed_ids is not None else None
    ref = reference_logprobs(learner, mb, allowed) if spec.beta > 0 else None
    old = sub.old_logprobs.to(device) if sub.old_logprobs is not None else None
    adv_tok = sub.advantages.to(device)[mb.seq_ids]
    row_scale = None  # [N] dL/dlogp, filled by the loss, applied to the lm_head input's gradient
    if learner.defer_row_scale and mb.row_index is None and spec.objective.needs_logprobs_first(old is not None):
        row_scale = torch.empty(mb.targets.shape[0], dtype=torch.float32, device=device)
    logits = training_logits(learner, mb, grad_row_scale=row_scale)
    # an episode's env spans (tool results, observations) are out of the loss: mask 0 (data.py)
    mask = sub.loss_mask.to(device) if sub.loss_mask is not None \
        else torch.ones_like(mb.targets, dtype=torch.bool)
    # grpo/dr_grpo weights: each micro-batch holds whole sequences, global count of them
    batch = LossBatch(mb.targets, mask, sub.behaviour_logprobs.to(device), adv_tok, ref, seq_ids=mb.seq_ids,
                      old_logprobs=old, allowed_ids=allowed, num_seqs=num_seqs, num_tokens=num_tokens)
    loss, stats = grpo_loss(logits, batch, spec, row_scale=row_scale)
    loss.backward()
    del logits
    n = stats["num_tokens"].float()
    micro = {"loss": loss.detach().float(), "clipped": stats["clip_fraction"] * n, "kl": stats["kl"] * n,
             "ratio": stats["ratio"] * n, "tokens": n, "is_weight": stats["is_weight"] * n,
             "mis_masked_seqs": stats["mis_masked_seqs"].float(), "entropy": stats["entropy"] * n}
    return Passes(torch.stack([micro[k] for k in MICRO_BATCH_STATS]), stats["ratio_max"].float(), mb.num_tokens)


def training_logits(learner: "Learner", mb: MicroBatch, grad_row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The training forward's [N, V] logits; a rider in `mb` is scored on the way, as the canary's
    reference of the current version (`Learner.probe_scored`)."""
    riders = [] if mb.rider is not None else None
    logits = micro_batch_logits(learner.model, mb, grad_row_scale=grad_row_scale, rider_logits=riders)
    if riders:
        learner.probe_scored = (learner.version, *probe_terms(riders[0], mb.rider))
    return logits
