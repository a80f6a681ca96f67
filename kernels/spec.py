"""What the loss is given: `LossSpec` (how the loss is computed, fixed for a run), `LossBatch` (one
call's per-token tensors, what the learner hands `grpo_loss`) and `LossRows` (the same rows once the
normalization is turned into weights and the vocabulary restricted: what every implementation
takes). The learner builds its `LossSpec` once from the config (`colocate/learner/loss.py`); this
package imports nothing of colocate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NORM_MODES = ("grpo", "dapo", "dr_grpo")
RATIO_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class Objective:
    """Which policy objective the loss computes (the defaults: GRPO with a token-level ratio)."""
    ratio_level: str = "token"   # token, or sequence (GSPO: geometric mean of the token ratios)
    tis_cap: float = 0.0         # > 0: truncated importance weight against the sampler, capped here
    mis_threshold: float = 0.0   # > 0: mask sequences whose mean |log-ratio| to the sampler exceeds it
    clip_ratio_c: float = 0.0    # > 1: dual clip of negative-advantage tokens at ratio c (verl); 0 = off

    def needs_logprobs_first(self, has_old: bool) -> bool:
        """Whether a token's coefficient depends on other tokens' or on its own log-prob before the
        gradient (the fused path then runs a forward-only pass first). The dual clip is one: the row
        kernel knows only the single clip, so its coefficient comes from the reference's own code."""
        return self.ratio_level == "sequence" or self.clip_ratio_c > 0 or (
            not has_old and (self.tis_cap > 0 or self.mis_threshold > 0))


@dataclass(frozen=True)
class LossSpec:
    """How the loss is computed: everything about it that is fixed for a run."""
    objective: Objective = Objective()
    norm: str = "dapo"            # NORM_MODES: the per-token weights (`reference.token_weights`)
    eps_low: float = 0.2          # the clip range of the ratio: [1 - eps_low, 1 + eps_high] (the
    eps_high: float = 0.28        # sequence range when the objective's ratio is a sequence's)
    beta: float = 0.0             # weight of the k3 KL to the reference policy
    temperature: float = 1.0      # the sampler's: log-probs of logits / temperature
    max_len: int | None = None    # dr_grpo: the fixed completion length
    impl: str = "auto"            # auto (the fused kernel on CUDA), triton or torch (the reference)


@dataclass
class LossBatch:
    """One `grpo_loss` call's per-token tensors, rows of its logits [N, V]."""
    targets: torch.Tensor                   # [N] sampled token ids
    mask: torch.Tensor                      # [N] bool/float, 1 = trained token
    behaviour_logprobs: torch.Tensor        # [N] float32 sampler log-probs
    advantages: torch.Tensor                # [N] float32 per-token advantage
    ref_logprobs: torch.Tensor | None = None   # [N] float32 reference policy (beta > 0)
    seq_ids: torch.Tensor | None = None        # [N] sequence index in [0, N) (grpo, dr_grpo, sequence ratio, MIS)
    old_logprobs: torch.Tensor | None = None   # [N] float32 learner log-probs at the start of the batch
    allowed_ids: torch.Tensor | None = None    # [N, K] int, -1 padded: the constraint's allowed ids
    num_seqs: int | None = None                # sequences in the (global) batch: grpo, dr_grpo
    num_tokens: int | float | None = None      # trained tokens in the (global) batch: dapo


@dataclass
class LossRows:
    """The rows every loss implementation takes: a `LossBatch` with its weights and restricted targets."""
    targets: torch.Tensor                   # [N] target index into the logits' (possibly restricted) vocabulary
    weights: torch.Tensor                   # [N] float32 = mask * normalization (`token_weights`), >= 0
    behaviour_logprobs: torch.Tensor        # [N] float32
    advantages: torch.Tensor                # [N] float32
    ref_logprobs: torch.Tensor | None = None   # [N] float32
    seq_ids: torch.Tensor | None = None        # [N] sequence index (sequence ratio, mis_threshold)
    old_logprobs: torch.Tensor | None = None   # [N] float32 learner log-probs at the start of the batch
