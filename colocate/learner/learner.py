"""Learner: GRPO steps on a LoRA adapter from packed trajectory batches, FSDP2 over learner ranks.

Set-up (`Learner.__init__`): the policy arrives on the meta device (or materialized, in tests) ->
activation checkpointing (`learner.activation_checkpointing`) -> torch.compile per block
(`learner.compile`) -> FSDP2 per decoder block, then the
root (`learner.fsdp`; bf16 compute, fp32 gradient reduction on GPU) -> `models.materialize`: each
rank fills only its shards, from `model.path` or a per-parameter seeded init -> AdamW over the
adapter parameters only.

One step = drop trajectories staler than `max_policy_lag` (`schedule.py`, as is the learning rate)
-> pack whole sequences into micro-batches of at most `micro_batch_tokens` tokens (no padding;
`packing.py`) -> forward, loss and backward of each, every rank running as many as the busiest one
(`passes.py`) -> clip the global grad norm -> AdamW (skipped on every rank when the loss or grad norm
is not finite) -> version += 1.

With `learner.updates_per_batch` = K > 1, one no-grad pass first gives every completion token's
log-prob under the adapter at the start of the step (`old_logprobs`, the policy the clip is taken
against), then the batch is split into K shuffled mini-batches (`mini_batch_indices`), each packed,
normalized over its own global counts and followed by its own AdamW step; the importance weight
against the sampler is truncated at `loss.tis_cap` (`loss.DECOUPLED_TIS_CAP` when unset). That pass also
measures the engine against the learner on the same weights (`learner/sampler_logprob_gap`: the
sequences sampled by the current version, so all of them at max_policy_lag 0). The version
still advances once per batch: it counts batches, which is what the step protocol and the lag
budget measure.

Normalizers (token and sequence counts) are global over the learner ranks, so the SUM of per-rank
gradients is the gradient of the global loss: FSDP's divide factor is 1 (`fsdp.apply_fsdp`); without
FSDP the adapter gradients are all-reduced (summed) by hand.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from colocate.data import TrajectoryBatch
from colocate.learner import fsdp
from colocate.learner.loss import loss_spec
from colocate.learner.packing import (MicroBatch, layout, layout_micro_batches, one_sequence, resolve_attention,
                                      set_attention)
from colocate.learner.packing import completion_logits as micro_batch_logits
from colocate.learner.passes import Passes, forward_backward, lm_head_frozen, probe_terms, start_logprobs
from colocate.learner.schedule import drop_stale, lr_factor, mini_batch_indices, mini_batch_seed
from colocate.learner.stats import BATCH_COUNTS, STEP_STATS, UpdateResult, by_name, signal_fraction, step_stats
from colocate.learner.tree_attention import TREE_FLEX
from colocate.learner.warmup import Snapshot, synthetic_batch
from colocate.models import base_identity, materialize
from colocate.startup import mark
from colocate.wire import unflatten_lora


POST_HEAD_LOGITS = ("final_logit_softcapping", "logits_scaling", "logit_scale")
"""Model config keys of a transform transformers applies to the logits after the lm_head (Gemma 2/3's
soft-capping, Granite's and Cohere's scales)."""


def head_is_last(config) -> bool:
    """Whether the model's logits are its lm_head's output as it is: then a rider's rows, split off at
    the head's input and put through the head alone (`packing.completion_logits`), get the logits the
    model gives. A scale of 1 changes nothing."""
    configs = [config, *([config.get_text_config()] if hasattr(config, "get_text_config") else [])]
    return all(getattr(c, key, None) in (None, 1, 1.0) for c in configs for key in POST_HEAD_LOGITS)


class Learner:
    def __init__(self, cfg, topology, model, tokenizer):
        self.cfg = cfg
        self.topology = topology
        self.model = model  # peft model; only adapter parameters require grad
        self.pad_id = tokenizer.pad_token_id
        self.vocab_size = len(tokenizer)  # what the base model's identity follows (`base`)
        self.device = topology.device
        lc = cfg.learner
        self.attention = resolve_attention(lc.attention, self.device, lc.prefix_sharing)
        set_attention(model, self.attention)
        if lc.activation_checkpointing:
            fsdp.apply_ac(model)
        if lc.compile:
            fsdp.apply_compile(model, nested_breaks=self.attention == TREE_FLEX)
        self.use_fsdp = lc.fsdp
        if self.use_fsdp:
            on_gpu = self.device.type == "cuda"
            fsdp.apply_fsdp(model, fsdp.learner_mesh(topology), param_dtype=torch.bfloat16 if on_gpu else None,
                            reduce_dtype=torch.float32 if on_gpu else None,
                            reshard_after_forward=lc.reshard_after_forward)
        if any(p.is_meta for p in model.parameters()):
            materialize(model, cfg.model, self.device)
        elif not self.use_fsdp:
            model.to(self.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lc.lr, weight_decay=lc.weight_decay)
        self.spec = loss_spec(cfg)  # the loss of every micro-batch
        self.defer_row_scale = lm_head_frozen(model)
        self.version = 0  # adapter version == batches trained (updates_per_batch optimizer steps each)
        self._gather = None  # fsdp.LoraGather, built on first use
        self._probe: tuple[tuple[int, ...], MicroBatch] | None = None  # the canary probe's inputs (`score_probe`)
        # the canary's probe rides the step's first forward (`train_step`) unless dropout, or a logit
        # transform after the head, makes it differ from the reference; then the loop scores it apart
        self.rides_probe = cfg.lora.dropout == 0 and head_is_last(model.config)
        self.probe_scored: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (version, log-probs, RMS)

    # ---- collectives over the learner group -------------------------------------------------------

    @functools.cached_property
    def base(self) -> dict:
        """The base model's identity (`models.base_identity`), in the manifest of every adapter and
        checkpoint this learner writes; computed once, from the config (no collective)."""
        return base_identity(self.cfg.model, self.vocab_size)

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.topology.num_learners > 1:
            dist.all_reduce(t, op=op, group=self.topology.learner_group)
        return t

    def _lora_gather(self) -> fsdp.LoraGather:
        if self._gather is None:
            self._gather = fsdp.LoraGather(self.model)
        return self._gather

    def lora_flat(self) -> torch.Tensor:
        """[numel] full adapter in `lora_spec` order, in a buffer the next call overwrites. With FSDP a
        collective: every learner calls it."""
        return self._lora_gather()()

    @property
    def lora_spec(self):
        return self._lora_gather().spec

    def lora_state(self) -> dict[str, torch.Tensor]:
        """Full adapter tensors by canonical name: views of `lora_flat()` (valid until the next call)."""
        return unflatten_lora(self.lora_flat(), self.lora_spec)

    # ---- micro-batches and the canary's probe -----------------------------------------------------

    def micro_batches(self, batch: TrajectoryBatch,
                      rider: list[int] | None = None) -> list[tuple[TrajectoryBatch, MicroBatch]]:
        """Micro-batches of at most `learner.micro_batch_tokens` forwarded tokens: whole sequences
        packed, or prefix trees (`learner.prefix_sharing`) -> (sub-batch, its model inputs) per
        micro-batch; a `rider` (the canary's probe) in the first one's inputs (`packing.with_rider`)."""
        lc = self.cfg.learner
        return layout_micro_batches(batch, lc.micro_batch_tokens, lc.prefix_sharing, self.device, self.attention,
                                    rider)

    def score_probe(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sync canary's reference (`colocate.canary`): [T-1] float32 log-probs of the probe under
        the current adapter (temperature 1, no mask, dropout off) from one forward in the learner's own
        layout and precision, and the RMS of those logits (the bound's scale, 0-dim), both left on the
        learner's device: nothing here waits for the forward. Every learner runs it (FSDP's all-gathers).
        Compiled blocks in train mode keep autograd on, so the probe runs the training forward's
        graphs (a gradient-free forward compiles graphs of its own: seconds at start-up) and the
        outputs are detached (nothing is kept for a backward); else it runs without gradients, which
        is cheaper."""
        mb = self._probe_inputs(token_ids)
        dropout = self.cfg.lora.dropout > 0
        if dropout:  # else train mode computes the same, and compiled blocks keep their graphs
            self.model.eval()  # the step's forward sets train() again
        with torch.set_grad_enabled(self.cfg.learner.compile and not dropout):
            return probe_terms(micro_batch_logits(self.model, mb), mb.targets)

    def _probe_inputs(self, token_ids: list[int]) -> MicroBatch:
        """The probe's model inputs on the device, laid out once and kept: the probe never changes,
        and a fresh layout per version would copy its tensors to the device, each copy waiting for
        the work queued before it (a pageable host-to-device copy synchronizes the stream)."""
        key = tuple(token_ids)
        if self._probe is None or self._probe[0] != key:
            ((_, _, mb),) = layout(one_sequence(token_ids), len(token_ids), self.cfg.learner.prefix_sharing,
                                   self.device, self.attention)
            self._probe = (key, mb)
        return self._probe[1]

    # ---- the step ---------------------------------------------------------------------------------

    def warm_up(self, probe: list[int] | None = None) -> None:
        """One update of a synthetic batch of `micro_batch_tokens` tokens through the step's own path
        (the counts' all-reduce, packing, FSDP's all-gathers and reduce-scatters, compile, attention,
        the loss kernel, the grad-norm clip, AdamW's first step and its state), before the first
        batch: those first-call costs are paid while the engines start. With the canary's `probe`,
        the update carries it as the step does (`rides_probe`); else its own forward comes first
        (`score_probe`, its own shape), marked `learner_probe_warm` once done on the device (the
        start-up timeline tells its compile from the update's). Then the adapter, AdamW's state, the
        gradients, the RNG and the module mode are put back exactly (`Snapshot`), and the version is
        untouched: the run trains bit for bit as without it. Every learner calls it."""
        lc = self.cfg.learner
        # ids the embedding holds: a saved model's tokenizer may count more tokens than its embedding rows
        vocab = min(self.vocab_size, self.model.config.vocab_size)
        batch = synthetic_batch(vocab, int(lc.micro_batch_tokens), self.cfg.engine.max_new_tokens,
                                self.cfg.rollout.group_size, self.version)
        saved = Snapshot.capture(self)
        try:
            if probe and not self.rides_probe:
                self.score_probe(probe)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                mark("learner_probe_warm")
            rider = probe if probe and self.rides_probe else None
            counts = by_name(self._global_counts(batch, 0.0, 0), BATCH_COUNTS)  # all-reduce
            if lc.updates_per_batch > 1:
                batch.old_logprobs = start_logprobs(self, batch)
            self._update(self.micro_batches(batch, rider), counts["tokens"], int(counts["sequences"]), rider)
        finally:
            saved.restore(self)
            self.probe_scored = None

    def train_step(self, batch: TrajectoryBatch, probe: list[int] | None = None) -> dict[str, float]:
        """One batch: `updates_per_batch` optimizer steps. Every learner rank calls it, and every rank
        runs the same collectives in the same order whatever its share of the batch (which ones:
        the comments). With the canary's `probe` (and `rides_probe`), the probe rides the first
        forward: `probe_scored` holds the current version's reference after the step (else None)."""
        t0 = time.perf_counter()
        self.probe_scored = None
        rider = probe if probe and self.rides_probe else None
        batch, lag_sum, dropped = drop_stale(batch, self.version, self.cfg.learner.max_policy_lag)
        k = self.cfg.learner.updates_per_batch
        counts = by_name(self._global_counts(batch, lag_sum, dropped), BATCH_COUNTS)  # all-reduce
        lr = self.cfg.learner.lr * lr_factor(self.version, self.cfg.learner)
        if self.cfg.learner.scale_lr_by_signal:
            lr *= signal_fraction(counts)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if k == 1:
            with record_function("learner/pack"):  # annotations name the step's parts in profiler traces
                work = self.micro_batches(batch, rider) if batch.num_sequences else []
            updates, gap = [self._update(work, counts["tokens"], int(counts["sequences"]), rider)], {}
        else:
            with record_function("learner/start_logprobs"):
                batch.old_logprobs = start_logprobs(self, batch)  # FSDP: all-reduce (max), all-gathers
            gap = self._sampler_gap(batch)  # all-reduce
            updates = []
            seed = mini_batch_seed(self.cfg.rollout.seed, self.version)
            for j, idx in enumerate(mini_batch_indices(batch.num_sequences, k, seed)):
                mini, ride = batch.select(idx), rider if j == 0 else None  # the first update's version
                with record_function("learner/pack"):
                    work = self.micro_batches(mini, ride) if mini.num_sequences else []
                # the mini-batch's own global normalizers: all-reduce
                tokens, seqs = self._all_reduce(torch.tensor(
                    [float(mini.num_trained_tokens), float(mini.num_sequences)], device=self.device)).tolist()
                updates.append(self._update(work, tokens, int(seqs), ride))
        self.version += 1
        return {**step_stats(counts, updates, t0), **gap, "lr": lr}

    def _sampler_gap(self, batch: TrajectoryBatch) -> dict[str, float]:
        """The learner against the sampler on the same weights: mean |start log-prob - behaviour
        log-prob| (nats) over the trained tokens that had a choice (not forced by a constraint) of
        the sequences this version sampled (all of them at max_policy_lag 0); what is left is the
        engine's numerics. An episode's env spans are out (loss_mask). One all-reduce."""
        seq = torch.repeat_interleave(torch.arange(batch.num_sequences), batch.completion_lens)
        keep = (batch.versions.long() == self.version)[seq]
        if batch.loss_mask is not None:
            keep &= batch.loss_mask
        if batch.allowed_ids is not None:
            keep &= (batch.allowed_ids >= 0).sum(1) > 1
        diff = (batch.old_logprobs - batch.behaviour_logprobs).abs()
        gap, tokens = self._all_reduce(torch.tensor([float(diff[keep].sum()), float(keep.sum())],
                                                    device=self.device)).tolist()
        return {"sampler_gap_tokens": tokens, **({"sampler_logprob_gap": gap / tokens} if tokens else {})}

    def _update(self, work: list[tuple[TrajectoryBatch, MicroBatch]], num_tokens: float,
                num_seqs: int, rider: list[int] | None = None) -> UpdateResult:
        """Forward/backward over `work` normalized by the global trained tokens and sequences, then
        one optimizer step. With the canary's probe as `rider` (in `work`'s first micro-batch, built
        by `micro_batches`), the first pass scores it; with no pass at all, a forward of its own does."""
        num_micro = self.num_micro_batches(len(work))  # FSDP: all-reduce (max)
        if rider and not num_micro:  # this rank runs no pass (under FSDP: no rank does)
            self.probe_scored = (self.version, *self.score_probe(rider))
        # FSDP: all-gathers and reduce-scatters per micro-batch
        passes = forward_backward(self, work, num_micro, num_seqs, num_tokens, rider)
        self._sum_gradients_without_fsdp()  # no FSDP, several ranks: one all-reduce per adapter tensor
        with record_function("learner/optimizer"):
            # FSDP: the grad norm's all-reduce; then the stats' all-reduces
            return self._optimizer_step(passes, num_micro)

    def _global_counts(self, batch: TrajectoryBatch, lag_sum: float, dropped: int) -> torch.Tensor:
        """[BATCH_COUNTS] summed over the learner ranks (a zero advantage: a group whose rewards are
        all equal, no signal). Its tokens and sequences are the loss's global normalizers."""
        local = {"tokens": batch.num_trained_tokens, "sequences": batch.num_sequences,
                 "reward": float(batch.rewards.sum()), "lag": lag_sum, "dropped": dropped,
                 "flat_tokens": float(batch.seq_lens.sum()), "zero_adv": float((batch.advantages == 0).sum()),
                 "reward_errors": float(batch.reward_errors.sum()) if batch.reward_errors is not None else 0.0}
        return self._all_reduce(torch.tensor([float(local[k]) for k in BATCH_COUNTS], device=self.device))

    def num_micro_batches(self, local: int) -> int:
        """Under FSDP every rank must run the same number of forward/backward passes: the busiest
        rank's count."""
        if not self.use_fsdp:
            return local
        return int(self._all_reduce(torch.tensor([float(local)], device=self.device),
                                    op=dist.ReduceOp.MAX).item())

    def _sum_gradients_without_fsdp(self) -> None:
        """Without FSDP, sum the adapter gradients over the learner ranks by hand (the loss is already
        globally normalized); FSDP reduce-scatters them itself during backward."""
        if self.use_fsdp or self.topology.num_learners == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.topology.learner_group)

    def _optimizer_step(self, passes: Passes, num_micro: int) -> UpdateResult:
        """Clip the global grad norm, reduce the stats over the ranks, step AdamW.

        A non-finite loss or gradient skips the update on every rank alike (both values are global);
        the version still advances, so the step protocol with the inference ranks is unchanged."""
        max_norm = self.cfg.learner.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"))
        if isinstance(grad_norm, DTensor):  # under FSDP: the global norm
            grad_norm = grad_norm.full_tensor()
        tokens = torch.tensor([float(passes.model_tokens)], device=self.device)
        sums = self._all_reduce(torch.cat([passes.sums, tokens]))
        ratio_max = self._all_reduce(passes.ratio_max.reshape(1).clone(), op=dist.ReduceOp.MAX)[0]
        skipped = not (torch.isfinite(sums[STEP_STATS.index("loss")]) and torch.isfinite(grad_norm))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return UpdateResult(sums, ratio_max, grad_norm, skipped, num_micro)
