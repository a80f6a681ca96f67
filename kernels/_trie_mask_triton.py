"""Triton side of `trie_mask.py` (imported only when the kernel runs): one program per logit row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_E, BLOCK_V = 64, 4096
SCRATCH_ALIGN = 64
"""The scratch row's length is rounded up to this: its stride keeps one Triton specialization
(divisible by 16) whatever the pool's largest degree, so a new table never recompiles the kernel
inside a running engine (a compile stalls the engine ~1 s)."""


@triton.jit
def _advance_and_mask(logits_ptr, stride, vocab, rows_req_ptr,
                      active_ptr, eos_ptr, sbase_ptr, ebase_ptr, epoch_ptr, state_ptr, consumed_ptr, seen_ptr,
                      offsets_ptr, tokens_ptr, targets_ptr, history_ptr, history_stride, prompt_len_ptr,
                      total_len_ptr, scratch_ptr, scratch_stride, BLOCK_E: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_req_ptr + row).to(tl.int64)
    live = r >= 0  # vLLM pads with -1
    r = tl.where(live, r, 0)
    if tl.where(live, tl.load(active_ptr + r), 0) != 0:
        sb = tl.load(sbase_ptr + r)
        eb = tl.load(ebase_ptr + r).to(tl.int64)
        epoch = tl.load(epoch_ptr + r)
        fresh = tl.load(seen_ptr + r) != epoch
        state = tl.where(fresh, 0, tl.load(state_ptr + r))
        k = tl.where(fresh, 0, tl.load(consumed_ptr + r))
        start = tl.load(prompt_len_ptr + r)
        out_len = tl.load(total_len_ptr + r) - start
        e = tl.arange(0, BLOCK_E)
        while k < out_len:  # the output tokens not walked yet (one per decode step)
            tok = tl.load(history_ptr + r * history_stride + start + k)
            nxt = tl.full([], -1, tl.int32)
            lo = tl.load(offsets_ptr + sb + tl.maximum(state, 0))
            hi = tl.where(state >= 0, tl.load(offsets_ptr + sb + tl.maximum(state, 0) + 1), lo)
            for e0 in range(lo, hi, BLOCK_E):
                m = e0 + e < hi
                t = tl.load(tokens_ptr + eb + e0 + e, mask=m, other=-1)
                g = tl.load(targets_ptr + eb + e0 + e, mask=m, other=-1)
                nxt = tl.maximum(nxt, tl.max(tl.where(t == tok, g, -1), axis=0))
            state = nxt
            k += 1
        tl.store(state_ptr + r, state)
        tl.store(consumed_ptr + r, k)
        tl.store(seen_ptr + r, epoch)
        lo = tl.load(offsets_ptr + sb + tl.maximum(state, 0))
        hi = tl.where(state >= 0, tl.load(offsets_ptr + sb + tl.maximum(state, 0) + 1), lo)
        base = logits_ptr + row * stride
        srow = scratch_ptr + row * scratch_stride
        for e0 in range(lo, hi, BLOCK_E):  # keep the allowed logits aside
            m = e0 + e < hi
            t = tl.load(tokens_ptr + eb + e0 + e, mask=m, other=0)
            tl.store(srow + e0 - lo + e, tl.load(base + t, mask=m), mask=m)
        eos = tl.load(eos_ptr + r)
        eos_logit = tl.load(base + eos)
        tl.debug_barrier()
        for v0 in range(0, vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            tl.store(base + cols, tl.full([BLOCK_V], float("-inf"), tl.float32), mask=cols < vocab)
        tl.debug_barrier()
        if hi == lo:  # no edges: after EOS, or off the table
            tl.store(base + eos, eos_logit)
        for e0 in range(lo, hi, BLOCK_E):
            m = e0 + e < hi
            t = tl.load(tokens_ptr + eb + e0 + e, mask=m, other=0)
            tl.store(base + t, tl.load(srow + e0 - lo + e, mask=m), mask=m)


def launch(logits: torch.Tensor, rows_req: torch.Tensor, pool, req, max_degree: int) -> None:
    rows, vocab = logits.shape
    if rows == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("trie masks: logits rows must be contiguous")
    width = -(-max(max_degree, 1) // SCRATCH_ALIGN) * SCRATCH_ALIGN
    scratch = torch.empty(rows, width, dtype=logits.dtype, device=logits.device)
    _advance_and_mask[(rows,)](logits, logits.stride(0), vocab, rows_req,
                               req.active, req.eos, req.sbase, req.ebase, req.epoch, req.state, req.consumed, req.seen,
                               pool.offsets, pool.tokens, pool.targets, req.history, req.history.stride(0),
                               req.prompt_len, req.total_len, scratch, scratch.stride(0),
                               BLOCK_E=BLOCK_E, BLOCK_V=BLOCK_V, num_warps=8)
