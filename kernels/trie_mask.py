"""Constraint masks on the GPU: each row's automaton state advanced over its new tokens, then every
logit its state does not allow set to -inf (what the vLLM engine's sampler sees with
`engine.constraint_masks: ours`).

The automata are `colocate.constraint.TrieTable`s laid out in one pool (`Pool`: offsets, tokens,
targets, each table at its own state and edge base). Per request r (vLLM's request-state index):
  active[r]   1 when the request has a table
  eos[r]      the token allowed when the state has no edges (after EOS, or a token off the table)
  sbase[r], ebase[r]   where its table sits in the pool
  epoch[r]    bumped by the host when the index takes a new request; the device resets the state then
  state[r], consumed[r], seen[r]   device-owned: the state after `consumed` output tokens, and the
              epoch it belongs to
A row (one logit row of the step, request `rows_req[row]`) first walks its state over the output
tokens it has not consumed yet (`history[r, prompt_len[r] + k]` for k < total_len[r] - prompt_len[r]:
vLLM's own token history, pinned host memory the GPU reads through unified addressing: the walk
needs no copy and no host step, so it survives asynchronous scheduling and re-prefill after
preemption), then keeps only the allowed logits.

`advance_and_mask_reference` is the same in PyTorch (the parity tests' reference, and the path off
CUDA); `advance_and_mask` runs the Triton kernel on CUDA or under TRITON_INTERPRET=1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEAD = -1
"""The state after a token its state does not allow: only `eos` is allowed from there."""


@dataclass
class Pool:
    """The tables on the device (int32): state s of a table at base (sb, eb) allows
    tokens[eb + offsets[sb + s] : eb + offsets[sb + s + 1]], moving to the matching targets."""
    offsets: torch.Tensor
    tokens: torch.Tensor
    targets: torch.Tensor


@dataclass
class Requests:
    """Per request-state index: host-written (active, eos, sbase, ebase, epoch) and device-owned
    (state, consumed, seen) int32 vectors, and vLLM's token history."""
    active: torch.Tensor
    eos: torch.Tensor
    sbase: torch.Tensor
    ebase: torch.Tensor
    epoch: torch.Tensor
    state: torch.Tensor
    consumed: torch.Tensor
    seen: torch.Tensor
    history: torch.Tensor
    """[R, max_len] int32: prompt then output token ids."""
    prompt_len: torch.Tensor
    total_len: torch.Tensor


def _edges(pool: Pool, req: Requests, r: int, state: int) -> tuple[torch.Tensor, torch.Tensor]:
    if state == DEAD:
        return pool.tokens[:0], pool.targets[:0]
    sb, eb = int(req.sbase[r]), int(req.ebase[r])
    lo, hi = int(pool.offsets[sb + state]), int(pool.offsets[sb + state + 1])
    return pool.tokens[eb + lo:eb + hi], pool.targets[eb + lo:eb + hi]


def advance_and_mask_reference(logits: torch.Tensor, rows_req: torch.Tensor, pool: Pool, req: Requests) -> None:
    """In place: `logits` [N, V] and the device-owned state of the requests of `rows_req` [N]."""
    for row, r in enumerate(rows_req.tolist()):
        if r < 0 or not int(req.active[r]):
            continue
        state, k = (int(req.state[r]), int(req.consumed[r])) if int(req.seen[r]) == int(req.epoch[r]) else (0, 0)
        start, out_len = int(req.prompt_len[r]), int(req.total_len[r]) - int(req.prompt_len[r])
        while k < out_len:
            tokens, targets = _edges(pool, req, r, state)
            hit = (tokens == req.history[r, start + k]).nonzero()
            state = int(targets[hit[0, 0]]) if len(hit) else DEAD
            k += 1
        req.state[r], req.consumed[r], req.seen[r] = state, k, req.epoch[r]
        allowed = _edges(pool, req, r, state)[0].long()
        if len(allowed) == 0:
            allowed = req.eos[r:r + 1].long()
        keep = logits[row, allowed].clone()
        logits[row] = float("-inf")
        logits[row, allowed] = keep


def advance_and_mask(logits: torch.Tensor, rows_req: torch.Tensor, pool: Pool, req: Requests,
                     max_degree: int) -> None:
    """The Triton kernel on CUDA (or under TRITON_INTERPRET=1), the reference elsewhere.
    `max_degree`: at least the most edges of any state in the pool (the kernel's scratch row)."""
    import os
    if not (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return advance_and_mask_reference(logits, rows_req, pool, req)
    from ._trie_mask_triton import launch
    launch(logits, rows_req, pool, req, max_degree)
