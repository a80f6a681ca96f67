"""The sampled token's log-prob and rank under each row of [B, V] logits, in one read of the logits.

What vLLM's sampler returns when a request asks `logprobs=0` (the engine's behaviour log-prob):
  logprob[b] = x[b, t_b] - logsumexp(x[b, :])        rank[b] = #{v : x[b, v] >= x[b, t_b]}
vLLM 0.25's V2 sampler computes them with one program per row (`_topk_log_softmax_kernel`, two
passes over the row, then `_ranks_kernel`, a third), so a decode step's few rows read the whole
vocabulary three times on a few SMs while the rest of the GPU idles (figures: profiles/README.md,
`--profile logprob`). Here the row is cut into blocks of `BLOCK` logits, one program each (B x V / BLOCK programs):
each reads its block once and writes its max, its sum of exp(x - max) and its count of logits at
or above the sampled one; `_combine` folds a row's blocks into its logsumexp and rank.

`sampled_logprob_reference` is the same in PyTorch (the parity tests' reference, and the path off
CUDA). Logits of -inf (masked by a grammar) count as exp(-inf) = 0; a block of only -inf adds 0.
Triton is imported only when the kernel runs.
"""
from __future__ import annotations

import torch

from .reference import per_token_logprobs

BLOCK = 4096


def sampled_logprob_reference(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] float logits, [B] ids -> ([B] float32 log-probs, [B] int64 ranks)."""
    x = logits.float()
    chosen = x.gather(1, token_ids.long().view(-1, 1))
    return per_token_logprobs(x, token_ids, 1.0), (x >= chosen).sum(dim=-1)


def sampled_logprob(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA (or under TRITON_INTERPRET=1), the reference elsewhere."""
    import os
    if not (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return sampled_logprob_reference(logits, token_ids)
    from ._sampled_logprob_triton import launch
    return launch(logits, token_ids, BLOCK)
