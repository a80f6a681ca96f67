"""The Triton GRPO row kernel and its launch: forward and d(logits) in one kernel, one row at a time.

Role: `grpo_rows` is the fused loss's building block (`triton_grpo` wraps it in autograd). Calls
that write the gradient go to the bulk-copy CUDA row kernel (`cuda_grpo`: sm_90+, bf16; faster, see
profiles/README.md) when it supports them; this kernel takes the rest (fp32, other GPUs, forward
only, the CPU interpreter) and is the twin the CUDA kernel is tested against. Both compute
`reference.grpo_loss_reference`'s per-token loss, stats and d(logits).

Why one kernel: the per-token gradient dL/dlogp_t depends only on scalars the forward already has
(logp_t, behaviour_t, A_t, ref_t, w_t). So each program, for its row,
  pass 1  streams the row: sum 2^(z - r) in fp32 against r = the first block's max (a running
          max only if that sum overflows) -> logsumexp, logp, loss, g_t;
  pass 2  streams the row again, last block first, while it is still in L1/L2, and writes
          d(logits) = g_t * (onehot(target) - softmax) / T   in the logits dtype.
HBM traffic is ~4·N·V bytes (read once, write once) when pass 2 hits the caches, instead of the
6·N·V of a forward kernel plus a backward kernel that re-reads the logits (Liger's
`triton_grpo_loss`). No float32 [N, V] is materialized. Weights must be non-negative; rows with
weight 0 read nothing and get a zero gradient.

How it is laid out (tuned on an H200): persistent programs, one per SM; 32 warps; plain loads
prefetched one block ahead in registers (`stages: 0`), so L1 holds most of the row (~250 KB of its
304 KB at V=152064 bf16) for pass 2's backward walk and L2 the rest (`stages > 0` pipelines loads
through shared memory, bypassing L1, so pass 2 re-reads from DRAM). Pass 1's loads carry
evict_last; pass 2's none (evict_first measured slower). The kernel moves about the ideal bytes
but streams them well below peak DRAM bandwidth, hence the CUDA kernel. Designs tried and measured
slower (overlapped passes, split rows, fewer rows in flight, two blocks prefetched, ...):
profiles/HISTORY.md.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import cuda_grpo
from .launch_keys import check_keys

__all__ = ["grpo_rows", "row_backend", "default_config", "LOSS", "RATIO", "KL", "CLIPPED", "ACTIVE", "LOGP"]

# Columns of the per-row output buffer [N, 6] (summed on the host side of the kernel; LOGP, the
# target's log-prob, feeds objectives whose per-row coefficient needs every row's log-prob first).
LOSS, RATIO, KL, CLIPPED, ACTIVE, LOGP = range(6)


@triton.jit
def _load_block(x_row, blk, vocab, other, BLOCK_V: tl.constexpr, GROUP: tl.constexpr, EVICT: tl.constexpr):
    """Block `blk` of a row: [BLOCK_V], or [BLOCK_V // GROUP, GROUP] with each GROUP of contiguous
    columns in one thread (so reductions over a group stay inside the thread)."""
    if GROUP >= 2:
        offs = blk * BLOCK_V + tl.arange(0, BLOCK_V // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    else:
        offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    return tl.load(x_row + offs, mask=(offs >= 0) & (offs < vocab), other=other, eviction_policy=EVICT)


@triton.jit
def _online_update(m, s, z, GROUP: tl.constexpr):
    """Fold a block of z into the running (max, sum of 2^(z - max)).

    GROUP == 0: scalar state, two block-wide reductions (cross-warp, with barriers) per block.
    GROUP == 1: one state per lane, one exp2 per element and no reduction: 2^-|z - m| rescales
                the sum when z is the new max, else it is z's own term.
    GROUP >= 2: one state per group of GROUP columns held by one thread: in-thread max and sum,
                one exp2 per element plus one per group, no barrier.
    """
    if GROUP >= 2:
        m_new = tl.maximum(m, tl.max(z, 1))
        s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(z - m_new[:, None]), 1)
        m = m_new
    elif GROUP == 1:
        diff = z - m
        e = tl.exp2(-tl.abs(diff))
        is_new_max = diff > 0
        s = tl.where(is_new_max, s * e + 1.0, s + e)
        m = tl.where(is_new_max, z, m)
    else:
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(z - m_new), 0)
        m = m_new
    return m, s


@triton.jit
def _row_logsumexp2(x_row, vocab, log2e_over_t, BLOCK_V: tl.constexpr, GROUP: tl.constexpr,
                    STAGES: tl.constexpr, EVICT: tl.constexpr):
    """log2(sum_v 2^z_v) of one row, z = x * log2(e) / T, streamed BLOCK_V columns at a time.

    Running maxima start finite so that blocks of -inf (restricted vocabularies) give
    exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN. STAGES > 0: the compiler pipelines the
    loads (async copies into shared memory, STAGES - 1 blocks in flight); STAGES == 0: loads are
    prefetched one block ahead in registers.
    """
    num_blocks = tl.cdiv(vocab, BLOCK_V)
    if GROUP >= 2:
        m = tl.full([BLOCK_V // GROUP], -3.0e38, tl.float32)
        s = tl.zeros([BLOCK_V // GROUP], tl.float32)
    elif GROUP == 1:
        m = tl.full([BLOCK_V], -3.0e38, tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
    else:
        m = -3.0e38
        s = 0.0
    if STAGES > 0:
        for b in tl.range(0, num_blocks, num_stages=STAGES):
            x = _load_block(x_row, b, vocab, float("-inf"), BLOCK_V, GROUP, EVICT)
            m, s = _online_update(m, s, x.to(tl.float32) * log2e_over_t, GROUP)
    else:
        x_next = _load_block(x_row, 0, vocab, float("-inf"), BLOCK_V, GROUP, EVICT)
        for b in range(num_blocks):
            x = x_next
            x_next = _load_block(x_row, b + 1, vocab, float("-inf"), BLOCK_V, GROUP, EVICT)
            m, s = _online_update(m, s, x.to(tl.float32) * log2e_over_t, GROUP)
    if GROUP >= 1:
        m_row = tl.max(m, 0)
        lse2 = m_row + tl.log2(tl.sum(s * tl.exp2(m - m_row), 0))
    else:
        lse2 = m + tl.log2(s)
    return lse2


@triton.jit
def _row_logsumexp2_refmax(x_row, vocab, z_tgt, log2e_over_t, BLOCK_V: tl.constexpr, STAGES: tl.constexpr,
                           EVICT: tl.constexpr):
    """log2(sum_v 2^z_v) of one row against a fixed reference: the first block's max.

    fp32 holds 2^127, so terms need no running max: with r = the max of block 0 and the target's
    z (actual values of the row, so the sum is >= 1; the target keeps r finite when block 0 is all
    -inf, as in restricted vocabularies), each element costs one FFMA, one ex2 and one FADD into a
    per-lane sum (the online update also needs a max and a rescale per element: 11 SASS
    instructions per element against ~4 here). A later logit more than ~110 (base 2) above r
    overflows the sum to inf; the caller then redoes the row with the online update. Full blocks
    load unmasked; only the last, partial block is masked. STAGES == 0: plain loads, one block
    ahead in registers (past the last full block it re-loads that block: an L1 hit, unused).
    """
    cols = tl.arange(0, BLOCK_V)
    num_full = vocab // BLOCK_V
    x0 = tl.load(x_row + cols, mask=cols < vocab, other=float("-inf"), eviction_policy=EVICT).to(tl.float32)
    ref = tl.maximum(tl.maximum(tl.max(x0, 0) * log2e_over_t, z_tgt), -3.0e38)
    acc = tl.exp2(x0 * log2e_over_t - ref)                    # [BLOCK_V] per-lane partial sums
    if STAGES > 0:
        for b in tl.range(1, num_full, num_stages=STAGES):
            x = tl.load(x_row + b * BLOCK_V + cols, eviction_policy=EVICT).to(tl.float32)
            acc += tl.exp2(x * log2e_over_t - ref)
    else:  # plain loads (L1-cached, their L2 hint applies), one block ahead in registers
        x_next = tl.load(x_row + tl.maximum(tl.minimum(1, num_full - 1), 0) * BLOCK_V + cols, mask=cols < vocab,
                         eviction_policy=EVICT)
        for b in tl.range(1, num_full, num_stages=1):
            x = x_next
            x_next = tl.load(x_row + tl.minimum(b + 1, num_full - 1) * BLOCK_V + cols, eviction_policy=EVICT)
            acc += tl.exp2(x.to(tl.float32) * log2e_over_t - ref)
    if num_full >= 1 and num_full * BLOCK_V < vocab:  # the partial last block (block 0 was masked already)
        offs = num_full * BLOCK_V + cols
        x = tl.load(x_row + offs, mask=offs < vocab, other=float("-inf"), eviction_policy=EVICT).to(tl.float32)
        acc += tl.exp2(x * log2e_over_t - ref)
    return ref + tl.log2(tl.sum(acc, 0))


@triton.jit
def _write_row_grad(x_row, g_row, vocab, tgt, coef, p_tgt, lse2, log2e_over_t, BLOCK_V: tl.constexpr,
                    STAGES: tl.constexpr, EVICT: tl.constexpr):
    """g_row = coef * (onehot(tgt) - 2^(x * log2(e)/T - lse2)).

    Last block first: those were read most recently, so they are the likeliest still in L1 (plain
    loads) or L2. The partial tail block (masked) goes first, then the full blocks downwards,
    unmasked. Every column gets -coef * p; the target's coef * (1 - p_tgt) is stored after a
    barrier, so it lands after the block store that covers it (cheaper than a compare per
    element). One loop: two (one per sign of coef, with |coef| in the exponent) doubled the shared
    memory of the pipelined version, past an H200's 227 KB with fp32 logits, and measured no faster.
    """
    cols = tl.arange(0, BLOCK_V)
    num_full = vocab // BLOCK_V
    neg_coef = -coef
    if num_full * BLOCK_V < vocab:
        offs = num_full * BLOCK_V + cols
        x = tl.load(x_row + offs, mask=offs < vocab, other=0.0, eviction_policy=EVICT).to(tl.float32)
        d = tl.exp2(x * log2e_over_t - lse2) * neg_coef
        tl.store(g_row + offs, d.to(g_row.dtype.element_ty), mask=offs < vocab, eviction_policy=EVICT)
    if STAGES > 0:
        for j in tl.range(0, num_full, num_stages=STAGES):
            offs = (num_full - 1 - j) * BLOCK_V + cols
            x = tl.load(x_row + offs, eviction_policy=EVICT).to(tl.float32)
            d = tl.exp2(x * log2e_over_t - lse2) * neg_coef
            tl.store(g_row + offs, d.to(g_row.dtype.element_ty), eviction_policy=EVICT)
    else:  # plain loads (L1-cached, their L2 hint applies), one block ahead in registers
        x_next = tl.load(x_row + tl.maximum(num_full - 1, 0) * BLOCK_V + cols, mask=cols < vocab, eviction_policy=EVICT)
        for j in tl.range(0, num_full, num_stages=1):
            blk = num_full - 1 - j
            x = x_next
            x_next = tl.load(x_row + tl.maximum(blk - 1, 0) * BLOCK_V + cols, eviction_policy=EVICT)
            d = tl.exp2(x.to(tl.float32) * log2e_over_t - lse2) * neg_coef
            tl.store(g_row + blk * BLOCK_V + cols, d.to(g_row.dtype.element_ty), eviction_policy=EVICT)
    tl.debug_barrier()
    tl.store(g_row + tgt, (coef * (1.0 - p_tgt)).to(g_row.dtype.element_ty))


@triton.jit
def _grpo_rows_kernel(
    logits_ptr,      # [N, V] bf16/fp32, row stride `stride_logits`, unit column stride
    grad_ptr,        # [N, V] logits dtype; may alias logits_ptr (in-place backward)
    targets_ptr,     # [N] int
    weights_ptr,     # [N] fp32, mask * normalization
    behaviour_ptr,   # [N] fp32
    advantages_ptr,  # [N] fp32
    ref_ptr,         # [N] fp32 (ignored unless HAS_KL)
    dlogp_ptr,       # [N] fp32 dL/dlogp given per row (ignored unless HAS_DLOGP)
    row_out_ptr,     # [N, 6] fp32: w*l, ratio, kl, is_clipped, active, logp
    num_rows,
    rows_per_program,
    vocab,
    stride_logits,
    stride_grad,
    log2e_over_t,    # log2(e) / T: work in base 2 so each exponential is one ex2
    inv_t,
    eps_low,
    eps_high,
    beta,
    HAS_KL: tl.constexpr,
    HAS_DLOGP: tl.constexpr,    # the gradient's coefficient is w * dlogp[row] / T instead of GRPO's
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,        # pass-1 reduction: 0 block-wide, 1 per lane, >= 2 per group of columns
    STAGES: tl.constexpr,       # pass 1: > 0 software-pipelined loads (STAGES - 1 blocks in flight); 0 register prefetch
    STAGES2: tl.constexpr,      # the same for pass 2
    EVICT_PASS1: tl.constexpr,  # L2 hints of pass 1's loads (evict_last: keep the row for pass 2) and of pass 2's
    EVICT_PASS2: tl.constexpr,
    PASS1_REFMAX: tl.constexpr,  # pass 1 against the first block's max (fallback: online), else online
):
    LN2: tl.constexpr = 0.6931471805599453
    cols = tl.arange(0, BLOCK_V)
    num_blocks = tl.cdiv(vocab, BLOCK_V)
    # Persistent programs: a fixed number of rows in flight (pass 2 re-reads each row while most
    # of it is still in L1/L2); program p walks rows p, p + G, ... The next row's scalars are
    # loaded one row ahead so their latency hides under the current row's passes.
    step = tl.num_programs(0)
    row = tl.program_id(0)
    w_next = tl.load(weights_ptr + row, mask=row < num_rows, other=0.0)
    tgt_next = tl.load(targets_ptr + row, mask=row < num_rows, other=0).to(tl.int32)
    behaviour_next = tl.load(behaviour_ptr + row, mask=row < num_rows, other=0.0)
    adv_next = tl.load(advantages_ptr + row, mask=row < num_rows, other=0.0)
    ref_next = 0.0
    if HAS_KL:
        ref_next = tl.load(ref_ptr + row, mask=row < num_rows, other=0.0)
    for i in range(rows_per_program):
        row = tl.program_id(0) + i * step
        w, tgt, behaviour, adv, ref = w_next, tgt_next, behaviour_next, adv_next, ref_next
        has_next = row + step < num_rows
        w_next = tl.load(weights_ptr + row + step, mask=has_next, other=0.0)
        tgt_next = tl.load(targets_ptr + row + step, mask=has_next, other=0).to(tl.int32)
        behaviour_next = tl.load(behaviour_ptr + row + step, mask=has_next, other=0.0)
        adv_next = tl.load(advantages_ptr + row + step, mask=has_next, other=0.0)
        if HAS_KL:
            ref_next = tl.load(ref_ptr + row + step, mask=has_next, other=0.0)

        row64 = tl.cast(row, tl.int64)  # row * stride passes 2**31 elements at N·V ~ 2.5e9
        x_row = logits_ptr + row64 * stride_logits
        g_row = grad_ptr + row64 * stride_grad
        out = row_out_ptr + row64 * 6
        if row < num_rows:
            if w > 0:
                # Target logit first: in place, pass 2 (after a barrier) overwrites it.
                z_tgt = tl.load(x_row + tgt).to(tl.float32) * log2e_over_t
                if PASS1_REFMAX:
                    lse2 = _row_logsumexp2_refmax(x_row, vocab, z_tgt, log2e_over_t, BLOCK_V, STAGES, EVICT_PASS1)
                    if not (lse2 < 3.0e38):  # the sum overflowed (a logit far above block 0's max)
                        lse2 = _row_logsumexp2(x_row, vocab, log2e_over_t, BLOCK_V, GROUP, STAGES, EVICT_PASS1)
                else:
                    lse2 = _row_logsumexp2(x_row, vocab, log2e_over_t, BLOCK_V, GROUP, STAGES, EVICT_PASS1)
                logp = (z_tgt - lse2) * LN2

                # Per-token GRPO terms, as in reference.objective_terms with its defaults.
                ratio = tl.exp(logp - behaviour)
                clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
                loss = -tl.minimum(ratio * adv, clipped * adv)
                is_clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
                # d(-min(ratio A, clip(ratio) A))/dlogp: -ratio*A on the unclipped branch, 0 when clipped.
                dloss_dlogp = tl.where(is_clipped, 0.0, -ratio * adv)
                kl = 0.0
                if HAS_KL:
                    delta = ref - logp
                    exp_delta = tl.exp(delta)
                    kl = exp_delta - delta - 1.0
                    loss += beta * kl
                    dloss_dlogp += beta * (1.0 - exp_delta)
                if HAS_DLOGP:  # an objective computed outside from a forward-only pass's LOGP
                    dloss_dlogp = tl.load(dlogp_ptr + row)
                tl.store(out + 0, w * loss)
                tl.store(out + 1, ratio)
                tl.store(out + 2, kl)
                tl.store(out + 3, is_clipped.to(tl.float32))
                tl.store(out + 4, 1.0)
                tl.store(out + 5, logp)

                if WRITE_GRAD:
                    # d loss / d x_v = w * dloss_dlogp * (onehot_v - p_v) / T
                    coef = w * dloss_dlogp * inv_t
                    tl.debug_barrier()  # every thread's read of the target logit precedes in-place writes
                    _write_row_grad(x_row, g_row, vocab, tgt, coef, tl.exp2(z_tgt - lse2), lse2, log2e_over_t,
                                    BLOCK_V, STAGES2, EVICT_PASS2)
            else:
                tl.store(out + 0, 0.0)
                tl.store(out + 1, 0.0)
                tl.store(out + 2, 0.0)
                tl.store(out + 3, 0.0)
                tl.store(out + 4, 0.0)
                tl.store(out + 5, 0.0)
                if WRITE_GRAD:  # masked rows: zero gradient, no read of the row
                    zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
                    for j in range(num_blocks):
                        offs = j * BLOCK_V + cols
                        tl.store(g_row + offs, zeros, mask=offs < vocab, eviction_policy=EVICT_PASS2)


def default_config(vocab: int, device: torch.device) -> dict:
    """Launch parameters, tuned on an H200 at V=152064 bf16 (`--sweep` of the kernel benchmark).
    `stages`: pass 1's pipeline depth (0: register prefetch, one block ahead); `stages_pass2`: pass
    2's (None: the same); `pass1`: "refmax" or "online" (the running max, refmax's fallback);
    `evict_pass1` / `evict_pass2`: L2 hints of each pass's loads (and pass 2's stores);
    `num_programs` (not a default) fixes the grid, for tests. `backend`: "auto" sends calls that
    write the gradient to the bulk-copy CUDA kernel when it can take them (`cuda_grpo.unsupported`),
    "triton" never, "bulk" always (else an error says why); `bulk`: overrides of
    `cuda_grpo.DEFAULT_CONFIG`. 32 warps, register prefetch in both passes and no hint in pass 2
    measured fastest (profiles/HISTORY.md).
    """
    block_v = min(triton.next_power_of_2(vocab), 16384)
    cfg = {"block_v": block_v, "num_warps": 32, "programs_per_sm": 1, "group": 8, "stages": 0, "stages_pass2": None,
           "evict_pass1": "evict_last", "evict_pass2": "", "pass1": "refmax", "backend": "auto", "bulk": None}
    if device.type != "cuda":  # the interpreter (tests): one program per row, small blocks
        cfg.update(block_v=min(block_v, 1024), num_warps=4, programs_per_sm=0)
    return cfg


def _num_programs(num_rows: int, device: torch.device, cfg: dict) -> int:
    if cfg.get("num_programs"):  # explicit (tests: several rows per program under the interpreter)
        return max(1, min(num_rows, cfg["num_programs"]))
    if device.type != "cuda" or cfg["programs_per_sm"] <= 0:
        return max(num_rows, 1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(num_rows, int(sms * cfg["programs_per_sm"])))  # fractional: fewer rows in flight than SMs


def row_backend(logits: torch.Tensor, grad: torch.Tensor | None, cfg: dict) -> str:
    """"bulk" or "triton": the row kernel `grpo_rows` runs for this call under `cfg` (its config's
    `backend` and `bulk` keys). Raises for an unknown backend, or "bulk" forced where it cannot run."""
    if cfg["backend"] not in ("auto", "triton", "bulk"):
        raise ValueError(f"grpo kernel config: backend {cfg['backend']!r} is not one of auto, triton, bulk")
    if cfg["backend"] == "triton" or grad is None:  # forward only: the Triton kernel reads each row once
        return "triton"
    why = cuda_grpo.unsupported(logits, grad, cfg["bulk"])
    if why is not None and cfg["backend"] == "bulk":
        raise ValueError(f"grpo kernel: backend 'bulk' cannot take this call: {why}")
    return "bulk" if why is None else "triton"


def grpo_rows(
    logits: torch.Tensor,              # [N, V] bf16/fp32, unit column stride
    targets: torch.Tensor,             # [N]
    weights: torch.Tensor,             # [N] fp32
    behaviour_logprobs: torch.Tensor,  # [N]
    advantages: torch.Tensor,          # [N]
    ref_logprobs: torch.Tensor | None,
    grad: torch.Tensor | None,         # [N, V] output (may be `logits` itself) or None for forward only
    dlogp: torch.Tensor | None = None,  # [N] fp32: dL/dlogp per row, replacing GRPO's (weights still scale it)
    *,
    temperature: float,
    eps_low: float,
    eps_high: float,
    beta: float,
    config: dict | None = None,
) -> torch.Tensor:                     # [N, 6] fp32 per-row outputs (columns LOSS ... LOGP)
    """Run the row kernel `row_backend` picks; writes `grad` when given."""
    assert logits.stride(1) == 1 and (grad is None or (grad.shape == logits.shape and grad.stride(1) == 1))
    cfg = default_config(logits.shape[1], logits.device)
    check_keys("grpo kernel config", config or {}, [*cfg, "num_programs"])
    cfg.update(config or {})
    kw = dict(temperature=temperature, eps_low=eps_low, eps_high=eps_high, beta=beta)
    if row_backend(logits, grad, cfg) == "bulk":
        return cuda_grpo.grpo_rows_bulk(logits, targets, weights, behaviour_logprobs, advantages, ref_logprobs,
                                        grad, dlogp, config=cfg["bulk"], **kw)
    return _launch_triton(logits, targets, weights, behaviour_logprobs, advantages, ref_logprobs, grad, dlogp, cfg,
                          **kw)


def _launch_triton(logits, targets, weights, behaviour_logprobs, advantages, ref_logprobs, grad, dlogp, cfg, *,
                   temperature, eps_low, eps_high, beta) -> torch.Tensor:
    """`_grpo_rows_kernel` over every row (arguments as `grpo_rows`; `cfg` complete) -> [N, 6]."""
    num_rows, vocab = logits.shape
    cfg = {**cfg, "block_v": min(cfg["block_v"], triton.next_power_of_2(vocab))}
    if cfg["group"] > cfg["block_v"] // 2:  # tiny vocabularies (restricted ids): block-wide reduction
        cfg["group"] = 0
    weights, behaviour_logprobs, advantages, ref, has_kl, dlogp, row_out = cuda_grpo.row_inputs(
        logits, weights, behaviour_logprobs, advantages, ref_logprobs, beta, dlogp)
    if num_rows == 0:
        return row_out
    num_programs = _num_programs(num_rows, logits.device, cfg)
    _grpo_rows_kernel[(num_programs,)](
        logits, grad if grad is not None else logits, targets.contiguous(), weights, behaviour_logprobs,
        advantages, ref, behaviour_logprobs if dlogp is None else dlogp, row_out,
        num_rows, triton.cdiv(num_rows, num_programs), vocab, logits.stride(0),
        grad.stride(0) if grad is not None else 0,
        math.log2(math.e) / temperature, 1.0 / temperature, eps_low, eps_high, beta,
        HAS_KL=has_kl, HAS_DLOGP=dlogp is not None, WRITE_GRAD=grad is not None, BLOCK_V=cfg["block_v"],
        GROUP=cfg["group"], STAGES=cfg["stages"],
        STAGES2=cfg["stages"] if cfg.get("stages_pass2") is None else cfg["stages_pass2"],
        EVICT_PASS1=cfg["evict_pass1"], EVICT_PASS2=cfg["evict_pass2"], PASS1_REFMAX=cfg["pass1"] == "refmax",
        num_warps=cfg["num_warps"],
    )
    return row_out
