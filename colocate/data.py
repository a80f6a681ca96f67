"""The data contracts between environment, engine, rollout worker and learner.

Engines take `Request`s and return `Completion`s (host-side lists: they are small and produced one
token at a time). Environments turn completions into `Sample`s with rewards. The rollout worker
turns samples into one `TrajectoryBatch` of packed tensors, which is what crosses the transport and
what the learner trains on: nothing is re-tokenized after sampling.

Packed layout: the B sequences (prompt + completion) are concatenated along one token axis of
length T = sum(seq_lens). Completion-only fields live on the N = sum(completion_lens) axis, in the
same order as the completion tokens appear in `tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Hashable

import numpy as np
import torch

from colocate.constraint import Constraint


@dataclass
class Request:
    prompt_ids: list[int]
    """Prompt token ids."""
    max_new_tokens: int
    temperature: float = 1.0
    constraint: Constraint | None = None
    """Allowed continuations; the engine samples only tokens it allows and ends with EOS."""


@dataclass
class Completion:
    token_ids: list[int]
    """[n] sampled ids, EOS included when sampled."""
    logprobs: list[float]
    """[n] log-prob of each sampled token after temperature and the constraint mask."""
    allowed_ids: list[list[int]] | None
    """[n][k_i] token ids the constraint allowed at each step (None when unconstrained)."""
    version: int
    """Adapter version that sampled its first token: the oldest that produced it (the lag budget
    applies to it). With `rollout.update=inflight` a request may run across an adapter update."""
    finish_reason: str = "stop"
    """stop (EOS or constraint finished) or length (max_new_tokens reached)."""
    loss_mask: list[bool] | None = None
    """[n] True where the policy sampled the token (it is trained), False for tokens the env appended
    (tool results, observations: an episode's env spans, `envs/agent.py`); None: every token trained."""
    last_version: int | None = None
    """Adapter version that sampled its last token (None: `version`, no update landed while it ran).
    vLLM records bounds: the version at submit as `version`, the one when its answer was read here."""
    token_versions: list[int] | None = None
    """[n] version that sampled each token, where the engine tracks it (the HF engine); None otherwise."""

    @property
    def newest_version(self) -> int:
        return self.version if self.last_version is None else self.last_version


@dataclass
class Sample:
    """One trained decision: a prompt, what the policy sampled, and its reward."""
    prompt_ids: list[int]
    completion: Completion
    reward: float
    group_key: Hashable
    """Samples sharing a key are normalized together (GRPO group; per power for Diplomacy)."""
    is_anchor: bool = True
    """Only anchors enter the group's mean/std; others (later phases) just receive the advantage."""
    info: dict = field(default_factory=dict)
    """What the env knows of the sample; `reward_error` True: a reward function gave it no usable
    value (it scores 0 from that function), counted in the step line and the summary."""


@dataclass
class TrajectoryBatch:
    tokens: torch.Tensor
    """[T] int32 prompt+completion ids of all sequences, concatenated."""
    seq_lens: torch.Tensor
    """[B] int32 prompt_len + completion_len per sequence."""
    prompt_lens: torch.Tensor
    """[B] int32."""
    behaviour_logprobs: torch.Tensor
    """[N] float32 sampler log-probs of completion tokens."""
    advantages: torch.Tensor
    """[B] float32 group-normalized advantage per sequence."""
    rewards: torch.Tensor
    """[B] float32 raw reward per sequence."""
    versions: torch.Tensor
    """[B] int32 adapter version of each sequence's first (oldest) token: what the lag budget and
    `learner/policy_lag` measure (`Completion.version`)."""
    allowed_ids: torch.Tensor | None = None
    """[N, K] int32 allowed token ids per completion token, -1 padded; None when unconstrained."""
    old_logprobs: torch.Tensor | None = None
    """[N] float32 learner log-probs at the start of the step (filled by the learner when
    learner.updates_per_batch > 1: the policy its mini-batches clip against)."""
    loss_mask: torch.Tensor | None = None
    """[N] bool: completion tokens in the loss (an episode's policy spans); False for env spans (their
    behaviour log-probs are 0 and unused). None: every completion token is trained."""
    reward_errors: torch.Tensor | None = None
    """[B] bool: the sequence got no usable reward from a reward function (`Sample.info`); None: none."""

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def completion_lens(self) -> torch.Tensor:  # [B]
        return self.seq_lens - self.prompt_lens

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_lens.sum())

    @property
    def num_trained_tokens(self) -> int:
        """Completion tokens in the loss (the dapo normalizer): all of them unless `loss_mask` says otherwise."""
        return self.num_completion_tokens if self.loss_mask is None else int(self.loss_mask.sum())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Non-None tensor fields by name (what the transport sends)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def select(self, indices: list[int]) -> "TrajectoryBatch":
        """The sub-batch of the given sequences, still packed."""
        seq_start = torch.cumsum(self.seq_lens, 0) - self.seq_lens
        comp_lens = self.completion_lens
        comp_start = torch.cumsum(comp_lens, 0) - comp_lens
        tok = torch.cat([self.tokens[seq_start[i]: seq_start[i] + self.seq_lens[i]] for i in indices]) \
            if indices else self.tokens[:0]

        def comp(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if not indices:
                return t[:0]
            return torch.cat([t[comp_start[i]: comp_start[i] + comp_lens[i]] for i in indices])

        idx = torch.tensor(indices, dtype=torch.long)
        return TrajectoryBatch(
            tokens=tok, seq_lens=self.seq_lens[idx], prompt_lens=self.prompt_lens[idx],
            behaviour_logprobs=comp(self.behaviour_logprobs), advantages=self.advantages[idx],
            rewards=self.rewards[idx], versions=self.versions[idx], allowed_ids=comp(self.allowed_ids),
            old_logprobs=comp(self.old_logprobs),
            loss_mask=comp(self.loss_mask),
            reward_errors=self.reward_errors[idx] if self.reward_errors is not None else None)

    @staticmethod
    def concat(batches: list["TrajectoryBatch"]) -> "TrajectoryBatch":
        def cat(name: str) -> torch.Tensor | None:
            parts = [getattr(b, name) for b in batches]
            if name == "loss_mask" and any(p is not None for p in parts):  # None: all trained
                parts = [p if p is not None else torch.ones(b.num_completion_tokens, dtype=torch.bool)
                         for p, b in zip(parts, batches)]
            if name == "reward_errors" and any(p is not None for p in parts):  # None: no errors
                parts = [p if p is not None else torch.zeros(b.num_sequences, dtype=torch.bool)
                         for p, b in zip(parts, batches)]
            if any(p is None for p in parts):
                return None
            if name == "allowed_ids":  # pad K to the widest batch
                k = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, k - p.shape[1]), value=-1) for p in parts]
            return torch.cat(parts)
        return TrajectoryBatch(**{f.name: cat(f.name) for f in fields(TrajectoryBatch)})


def shard_batch(batch: TrajectoryBatch, num_shards: int) -> list[TrajectoryBatch]:
    """Contiguous split by sequence into `num_shards` (sizes differ by at most one): one per learner."""
    n = batch.num_sequences
    bounds = [round(i * n / num_shards) for i in range(num_shards + 1)]
    return [batch.select(list(range(bounds[i], bounds[i + 1]))) for i in range(num_shards)]


def host_tensor(values: list, dtype) -> torch.Tensor:
    """A flat list of numbers as a tensor of numpy `dtype`: ~3.5x faster than `torch.tensor` for a
    batch's 10^5 tokens (a batch is built after its last answer, while the learner waits)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))


def build_batch(samples: list[Sample], advantages: list[float]) -> TrajectoryBatch:
    """Samples (host lists) -> one packed TrajectoryBatch."""
    tokens, logprobs, allowed = [], [], []
    seq_lens, prompt_lens, versions = [], [], []
    constrained = all(s.completion.allowed_ids is not None for s in samples) and samples
    masked = any(s.completion.loss_mask is not None for s in samples)
    loss_mask: list[bool] = []
    for s in samples:
        c = s.completion
        tokens.extend(s.prompt_ids)
        tokens.extend(c.token_ids)
        logprobs.extend(c.logprobs)
        seq_lens.append(len(s.prompt_ids) + len(c.token_ids))
        prompt_lens.append(len(s.prompt_ids))
        versions.append(c.version)
        if constrained:
            allowed.extend(c.allowed_ids)
        if masked:
            loss_mask.extend(c.loss_mask if c.loss_mask is not None else [True] * len(c.token_ids))
    errors = [bool(s.info.get("reward_error")) for s in samples]
    allowed_t = None
    if constrained:
        k = max((len(a) for a in allowed), default=1)
        allowed_t = torch.full((len(allowed), k), -1, dtype=torch.int32)
        for i, a in enumerate(allowed):
            allowed_t[i, : len(a)] = torch.tensor(a, dtype=torch.int32)
    return TrajectoryBatch(
        tokens=host_tensor(tokens, np.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.int32),
        behaviour_logprobs=host_tensor(logprobs, np.float32),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        versions=torch.tensor(versions, dtype=torch.int32),
        allowed_ids=allowed_t,
        loss_mask=host_tensor(loss_mask, np.bool_) if masked else None,
        reward_errors=torch.tensor(errors, dtype=torch.bool) if any(errors) else None,
    )


def group_advantages(samples: list[Sample], eps: float = 1e-6, scale_by_std: bool = True) -> list[float]:
    """GRPO advantage: (reward - mean) / (std + eps) over the anchors of each group key; exactly 0 for
    every sample of a group whose rewards are all equal (the mean of six 0.7s is not 0.7 in floating
    point: without this a uniform group would carry ~1e-10 advantages and count as signal)."""
    stats: dict[Any, list[float]] = {}
    for s in samples:
        if s.is_anchor:
            stats.setdefault(s.group_key, []).append(s.reward)
    moments = {}  # group key -> (uniform, first reward, mean, std), once per group
    for key, rewards in stats.items():
        r = torch.tensor(rewards, dtype=torch.float64)
        std = r.std(unbiased=False) if r.numel() > 1 else r.new_zeros(())
        moments[key] = (bool((r == r[0]).all()), float(r[0]), r.mean(), std)
    out = []
    for s in samples:
        if s.group_key not in moments:
            out.append(0.0)  # a group of one (no anchor): its own mean
            continue
        uniform, first, mean, std = moments[s.group_key]
        if uniform and s.reward == first:
            out.append(0.0)  # a uniform group: no signal
            continue
        adv = (s.reward - mean) / (std + eps) if scale_by_std else s.reward - mean
        out.append(float(adv))
    return out
