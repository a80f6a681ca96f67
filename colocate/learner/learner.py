"""Learner: GRPO steps on a LoRA adapter from packed trajectory batches.

One step = drop trajectories staler than `max_policy_lag` -> split into micro-batches by token
budget -> (beta > 0) adapter-disabled no-grad pass for reference log-probs -> policy forward to
logits at completion positions only -> `colocate.kernels.grpo_loss` -> backward -> sum gradients
over learner ranks -> clip -> AdamW -> version += 1.

Normalizers (token and sequence counts) are global over the learner ranks, so summing per-rank
gradients gives the gradient of the global loss. Micro-batches are padded to their longest
sequence; token-budget packing with varlen attention and FSDP2 sharding belong to the FSDP2 issue.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from colocate.data import TrajectoryBatch
from colocate.kernels import grpo_loss, restrict_to_allowed
from colocate.kernels.reference import per_token_logprobs


def micro_batches(seq_lens: list[int], token_budget: int) -> list[list[int]]:
    """Greedy split of sequence indices so each micro-batch's padded size <= budget (>= 1 seq each)."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(seq_lens):
        if cur and max(longest, n) * (len(cur) + 1) > token_budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


class CompletionView:
    """Padded model inputs of a micro-batch plus its completion-row bookkeeping."""

    def __init__(self, mb: TrajectoryBatch, pad_id: int, device):
        seq_lens, prompt_lens = mb.seq_lens.tolist(), mb.prompt_lens.tolist()
        width = max(seq_lens)
        self.input_ids = torch.full((len(seq_lens), width), pad_id, dtype=torch.long)
        self.attention_mask = torch.zeros((len(seq_lens), width), dtype=torch.long)
        rows, cols, seq_ids = [], [], []
        offset = 0
        for r, (n, p) in enumerate(zip(seq_lens, prompt_lens)):
            self.input_ids[r, :n] = mb.tokens[offset:offset + n].long()
            self.attention_mask[r, :n] = 1
            # completion token at position t is predicted by the hidden state at t - 1
            rows += [r] * (n - p)
            cols += list(range(p - 1, n - 1))
            seq_ids += [r] * (n - p)
            offset += n
        self.input_ids = self.input_ids.to(device)
        self.attention_mask = self.attention_mask.to(device)
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)          # [N]
        self.cols = torch.tensor(cols, dtype=torch.long, device=device)          # [N]
        self.seq_ids = torch.tensor(seq_ids, dtype=torch.long, device=device)    # [N]
        self.targets = self.input_ids[self.rows, self.cols + 1]                  # [N]


def completion_logits(causal_lm, view: CompletionView) -> torch.Tensor:
    """[N, V] logits at completion positions; the lm_head runs on those rows only."""
    hidden = causal_lm.model(input_ids=view.input_ids, attention_mask=view.attention_mask).last_hidden_state
    return causal_lm.lm_head(hidden[view.rows, view.cols])


class Learner:
    def __init__(self, cfg, topology, model, tokenizer):
        self.cfg = cfg
        self.topology = topology
        self.model = model  # peft model; only adapter parameters require grad
        self.causal_lm = model.get_base_model()
        self.pad_id = tokenizer.pad_token_id
        self.device = topology.device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay)
        self.version = 0  # adapter version == optimizer steps taken
        if cfg.learner.activation_checkpointing:
            self.causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.topology.num_learners > 1:
            dist.all_reduce(t, group=self.topology.learner_group)
        return t

    @torch.no_grad()
    def reference_logprobs(self, view: CompletionView, allowed: torch.Tensor | None) -> torch.Tensor:
        """[N] log-probs of the adapter-disabled model (same temperature and constraint mask)."""
        with self.model.disable_adapter():
            logits = completion_logits(self.causal_lm, view)
        targets = view.targets
        if allowed is not None:
            logits, targets = restrict_to_allowed(logits, targets, allowed)
        return per_token_logprobs(logits, targets, self.cfg.engine.temperature)

    def train_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        cfg = self.cfg
        lag = self.version - batch.versions.long()
        keep = (lag <= cfg.learner.max_policy_lag).nonzero().flatten().tolist()
        dropped = batch.num_sequences - len(keep)
        if dropped:
            batch = batch.select(keep)
        # Global normalizers over all learner ranks.
        counts = self._all_reduce(torch.tensor(
            [float(batch.num_completion_tokens), float(batch.num_sequences), float(batch.rewards.sum()),
             float(lag[keep].float().sum()) if keep else 0.0, float(dropped)], device=self.device))
        num_tokens, num_seqs = counts[0].item(), int(counts[1].item())

        self.model.train()
        totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "ratio": 0.0}
        tokens_done = 0
        for mb_idx in micro_batches(batch.seq_lens.tolist(), cfg.learner.micro_batch_tokens):
            mb = batch.select(mb_idx)
            view = CompletionView(mb, self.pad_id, self.device)
            allowed = mb.allowed_ids.to(self.device) if mb.allowed_ids is not None else None
            ref = self.reference_logprobs(view, allowed) if cfg.loss.beta > 0 else None
            adv_tok = mb.advantages.to(self.device)[view.seq_ids]
            logits = completion_logits(self.causal_lm, view)
            loss, stats = grpo_loss(
                logits, view.targets, torch.ones_like(view.targets, dtype=torch.bool),
                mb.behaviour_logprobs.to(self.device), adv_tok, ref,
                temperature=cfg.engine.temperature, eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high,
                beta=cfg.loss.beta, norm=cfg.loss.norm,
                # grpo/dr_grpo weights: each micro-batch holds whole sequences, global count of them
                seq_ids=view.seq_ids, num_seqs=num_seqs, max_len=cfg.engine.max_new_tokens,
                num_tokens=num_tokens, allowed_ids=allowed, impl=cfg.loss.impl)
            loss.backward()
            n = float(stats["num_tokens"])
            tokens_done += int(n)
            totals["loss"] += float(loss)
            for k in ("clip_fraction", "kl", "ratio"):
                totals[k] += float(stats[k]) * n
        # Sum gradients over learner ranks (the loss is already globally normalized).
        if self.topology.num_learners > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.topology.learner_group)
        max_norm = cfg.learner.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

        sums = self._all_reduce(torch.tensor([totals["loss"], totals["clip_fraction"], totals["kl"],
                                              totals["ratio"], float(tokens_done)], device=self.device))
        denom = max(float(sums[4]), 1.0)
        elapsed = time.perf_counter() - t0
        return {
            "loss": float(sums[0]),
            "clip_fraction": float(sums[1]) / denom,
            "kl": float(sums[2]) / denom,
            "ratio": float(sums[3]) / denom,
            "grad_norm": float(grad_norm),
            "reward": float(counts[2]) / max(num_seqs, 1),
            "policy_lag_mean": float(counts[3]) / max(num_seqs, 1),
            "dropped_stale": float(counts[4]),
            "tokens": float(sums[4]),
            "step_s": elapsed,
            "tokens_per_s": float(sums[4]) / max(elapsed, 1e-9),
        }
