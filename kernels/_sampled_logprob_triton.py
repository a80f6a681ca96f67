"""Triton side of `sampled_logprob.py` (imported only when the kernel runs)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _blocks(logits_ptr, stride, token_ptr, max_ptr, sum_ptr, count_ptr, vocab, num_blocks,
            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    base = logits_ptr + row * stride
    chosen = tl.load(base + tl.load(token_ptr + row)).to(tl.float32)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)  # a block of only -inf: every exp is 0
    s = tl.sum(tl.exp(x - shift), axis=0)
    n = tl.sum(((x >= chosen) & (cols < vocab)).to(tl.int32), axis=0)  # not the -inf padding
    out = row * num_blocks + blk
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, s)
    tl.store(count_ptr + out, n)


@triton.jit
def _combine(logits_ptr, stride, token_ptr, max_ptr, sum_ptr, count_ptr, logprob_ptr, rank_ptr, num_blocks,
             NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chosen = tl.load(logits_ptr + row * stride + tl.load(token_ptr + row)).to(tl.float32)
    j = tl.arange(0, NB)
    valid = j < num_blocks
    m = tl.load(max_ptr + row * num_blocks + j, mask=valid, other=float("-inf"))
    s = tl.load(sum_ptr + row * num_blocks + j, mask=valid, other=0.0)
    n = tl.load(count_ptr + row * num_blocks + j, mask=valid, other=0)
    top = tl.max(m, axis=0)  # finite: the chosen logit is in some block
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0)
    tl.store(logprob_ptr + row, chosen - top - tl.log(total))
    tl.store(rank_ptr + row, tl.sum(n, axis=0).to(tl.int64))


def launch(logits: torch.Tensor, token_ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2:
        raise ValueError(f"sampled_logprob: logits must be [B, V], got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    num_blocks = triton.cdiv(vocab, block)
    token_ids = token_ids.reshape(-1).to(torch.int64).contiguous()
    part_max = torch.empty(rows, num_blocks, device=logits.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    part_count = torch.empty(rows, num_blocks, device=logits.device, dtype=torch.int32)
    logprobs = torch.empty(rows, device=logits.device, dtype=torch.float32)
    ranks = torch.empty(rows, device=logits.device, dtype=torch.int64)
    if rows == 0:
        return logprobs, ranks
    _blocks[(rows, num_blocks)](logits, logits.stride(0), token_ids, part_max, part_sum, part_count, vocab,
                                num_blocks, BLOCK=block, num_warps=8)
    _combine[(rows,)](logits, logits.stride(0), token_ids, part_max, part_sum, part_count, logprobs, ranks,
                      num_blocks, NB=triton.next_power_of_2(num_blocks))
    return logprobs, ranks
