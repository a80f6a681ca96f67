"""GRPO loss on logits, one DRAM read and one write per element: each row held in registers.

Role: a schedule of `triton_grpo.grpo_rows` (`config["schedule"] = "resident"`, CUDA only), for
the forward + in-place or fresh d(logits) call; same inputs, same [N, 5] per-row outputs.

Why: the row kernel (`_grpo_rows_kernel`) streams each row twice, pass 2 from L1/L2, and measured
65-67 % of peak DRAM bandwidth. Here a row is split into SPLITS chunks of CHUNK columns, one
program each, and every program keeps its chunk in registers from load to gradient store:
  1. load the chunk (and the target's logit), fold it into (max, sum 2^(z - max));
  2. publish that pair, packed into one int64, with an atomic exchange into partial[row, split];
  3. spin (volatile loads) until all SPLITS pairs of the row are there, combine them into the
     row's logsumexp; every sibling computes the same logp, loss and coefficient;
  4. write d(logits) = coef * (onehot(target) - softmax) / T for its chunk, from registers.
So the logits are read from DRAM once and the gradient written once, with no second pass.

Step 3 needs every sibling of a row resident at once: the grid is persistent (a fixed number of
row groups, each walking rows g, g + G, ...) and launched cooperatively, which the driver only
accepts when all programs fit on the GPU together. Not for the interpreter (it runs programs one
after another, so a sibling would wait forever): the CPU tests run SPLITS = 1, where the spin
sees its own pair at once. In place is safe: every sibling reads the target's logit before it
publishes, and nothing is written before all siblings have published.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASK32 = 0xFFFFFFFF


@triton.jit
def _pack(m, s):
    """(max, sum) fp32 -> one int64 (never 0: s >= 1 whenever m is finite, and m != 0.0 otherwise)."""
    hi = m.to(tl.uint32, bitcast=True).to(tl.uint64)
    lo = s.to(tl.uint32, bitcast=True).to(tl.uint64)
    return ((hi << 32) | lo).to(tl.int64, bitcast=True)


@triton.jit
def _unpack(v):
    hi = ((v >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    lo = (v & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return hi, lo


@triton.jit
def _grpo_resident_kernel(
    logits_ptr,      # [N, V] bf16/fp32, unit column stride
    grad_ptr,        # [N, V] logits dtype; may alias logits_ptr (in place)
    targets_ptr,     # [N] int
    weights_ptr,     # [N] fp32
    behaviour_ptr,   # [N] fp32
    advantages_ptr,  # [N] fp32
    ref_ptr,         # [N] fp32 (ignored unless HAS_KL)
    row_out_ptr,     # [N, 5] fp32: w*l, ratio, kl, is_clipped, active (split 0 writes them)
    partial_ptr,     # [N, SPLITS] int64, zeroed: packed (max, sum) per chunk; 0 = not yet published
    num_rows,
    num_groups,      # programs = num_groups * SPLITS; group g walks rows g, g + num_groups, ...
    vocab,
    chunk_len,       # columns per program (<= CHUNK, a multiple of 16); SPLITS * chunk_len >= vocab
    stride_logits,
    stride_grad,
    log2e_over_t,
    inv_t,
    eps_low,
    eps_high,
    beta,
    HAS_KL: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    LN2: tl.constexpr = 0.6931471805599453
    pid = tl.program_id(0)
    group = pid // SPLITS
    split = pid % SPLITS
    lanes = tl.arange(0, CHUNK)
    cols = split * chunk_len + lanes
    in_chunk = (lanes < chunk_len) & (cols < vocab)
    sib = tl.arange(0, SPLITS_P2)
    num_iters = tl.cdiv(num_rows - group, num_groups)
    # Software pipeline over this group's rows: iteration i publishes row i's pair, then finishes
    # row i - 1 (whose pairs were published an iteration ago, so the wait is short) from the
    # chunk still in registers. The chunk itself is held as loaded (bf16: half the registers).
    row = group
    w_cur = tl.load(weights_ptr + row, mask=row < num_rows, other=0.0)
    tgt_cur = tl.load(targets_ptr + row, mask=row < num_rows, other=0).to(tl.int32)
    x_cur = tl.load(logits_ptr + tl.cast(row, tl.int64) * stride_logits + cols, mask=tl.where(w_cur > 0, in_chunk, False),
                    other=float("-inf"))
    z_tgt_cur = tl.load(logits_ptr + tl.cast(row, tl.int64) * stride_logits + tgt_cur, mask=w_cur > 0,
                        other=0.0).to(tl.float32) * log2e_over_t
    # Fresh values, not aliases of the _cur ones: Triton's frontend carries a variable through the
    # loop only if the body gives it a value other than the one it had before the loop.
    x_prev = tl.full([CHUNK], float("-inf"), logits_ptr.dtype.element_ty)
    w_prev = 0.0
    tgt_prev = tl.full([], -1, tl.int32)
    z_tgt_prev = tl.full([], 0.0, tl.float32)
    for i in range(num_iters + 1):
        row = group + i * num_groups
        row64 = tl.cast(row, tl.int64)
        if (i < num_iters) & (w_cur > 0):  # 1. publish row i
            z = x_cur.to(tl.float32) * log2e_over_t
            m = tl.maximum(tl.max(tl.maximum(z, tl.minimum(z_tgt_cur, -3.0e38)), 0), -3.0e38)
            s = tl.sum(tl.exp2(z - m), 0)
            tl.atomic_xchg(partial_ptr + row64 * SPLITS + split, _pack(m, s), sem="relaxed")
        # 2. start loading row i + 1 (it lands while row i - 1 is finished below)
        row_next = row + num_groups
        has_next = row_next < num_rows
        w_next = tl.load(weights_ptr + row_next, mask=has_next, other=0.0)
        tgt_next = tl.load(targets_ptr + row_next, mask=has_next, other=0).to(tl.int32)
        x_next_row = logits_ptr + tl.cast(row_next, tl.int64) * stride_logits
        x_next = tl.load(x_next_row + cols, mask=tl.where(w_next > 0, in_chunk, False), other=float("-inf"))
        z_tgt_next = tl.load(x_next_row + tgt_next, mask=w_next > 0, other=0.0).to(tl.float32) * log2e_over_t
        # 3. finish row i - 1
        if i > 0:
            prow = row - num_groups
            prow64 = tl.cast(prow, tl.int64)
            out = row_out_ptr + prow64 * 5
            g_row = grad_ptr + prow64 * stride_grad
            if w_prev > 0:
                parts = partial_ptr + prow64 * SPLITS + sib
                v = tl.atomic_add(parts, 0, mask=sib < SPLITS, sem="relaxed")
                while tl.sum(((v == 0) & (sib < SPLITS)).to(tl.int32), 0) > 0:
                    v = tl.atomic_add(parts, 0, mask=sib < SPLITS, sem="relaxed")
                m_j, s_j = _unpack(v)
                m_j = tl.where(sib < SPLITS, m_j, -3.0e38)
                s_j = tl.where(sib < SPLITS, s_j, 0.0)
                m_row = tl.max(m_j, 0)
                lse2 = m_row + tl.log2(tl.sum(s_j * tl.exp2(m_j - m_row), 0))
                logp = (z_tgt_prev - lse2) * LN2

                # Per-token GRPO terms, as in reference.grpo_token_terms (and the row kernel).
                behaviour = tl.load(behaviour_ptr + prow)
                adv = tl.load(advantages_ptr + prow)
                ratio = tl.exp(logp - behaviour)
                clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
                loss = -tl.minimum(ratio * adv, clipped * adv)
                is_clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
                dloss_dlogp = tl.where(is_clipped, 0.0, -ratio * adv)
                kl = 0.0
                if HAS_KL:
                    delta = tl.load(ref_ptr + prow) - logp
                    exp_delta = tl.exp(delta)
                    kl = exp_delta - delta - 1.0
                    loss += beta * kl
                    dloss_dlogp += beta * (1.0 - exp_delta)
                if split == 0:
                    tl.store(out + 0, w_prev * loss)
                    tl.store(out + 1, ratio)
                    tl.store(out + 2, kl)
                    tl.store(out + 3, is_clipped.to(tl.float32))
                    tl.store(out + 4, 1.0)
                coef = w_prev * dloss_dlogp * inv_t
                p = tl.exp2(x_prev.to(tl.float32) * log2e_over_t - lse2)
                d = coef * (tl.where(cols == tgt_prev, 1.0, 0.0) - p)
                tl.store(g_row + cols, d.to(grad_ptr.dtype.element_ty), mask=in_chunk)
            else:  # masked row: nothing read, a zero gradient, no exchange
                if split == 0:
                    tl.store(out + 0, 0.0)
                    tl.store(out + 1, 0.0)
                    tl.store(out + 2, 0.0)
                    tl.store(out + 3, 0.0)
                    tl.store(out + 4, 0.0)
                tl.store(g_row + cols, tl.zeros([CHUNK], dtype=grad_ptr.dtype.element_ty), mask=in_chunk)
        x_prev, w_prev, tgt_prev, z_tgt_prev = x_cur, w_cur, tgt_cur, z_tgt_cur
        x_cur, w_cur, tgt_cur, z_tgt_cur = x_next, w_next, tgt_next, z_tgt_next


def launch_resident(logits, targets, weights, behaviour, advantages, ref, has_kl, grad, row_out, *,
                    log2e_over_t, inv_t, eps_low, eps_high, beta, cfg: dict):
    """Launch the resident kernel (all tensors prepared by `grpo_rows`). cfg: chunk, num_warps,
    programs_per_sm (the driver refuses a cooperative grid that does not fit on the GPU)."""
    num_rows, vocab = logits.shape
    chunk = min(cfg["chunk"], triton.next_power_of_2(vocab))  # the block (power of two)
    splits = triton.cdiv(vocab, chunk)
    chunk_len = triton.cdiv(triton.cdiv(vocab, splits), 16) * 16  # the row spread evenly over the splits
    splits = triton.cdiv(vocab, chunk_len)
    if logits.is_cuda:
        sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
        num_groups = max(1, min(num_rows, int(sms * cfg["programs_per_sm"]) // splits))
        if int(sms * cfg["programs_per_sm"]) < splits:
            raise ValueError(f"resident schedule: {splits} chunks of {chunk} columns per row need "
                             f"{splits} programs at once, the GPU holds {int(sms * cfg['programs_per_sm'])}; "
                             f"raise chunk or programs_per_sm")
    else:  # the interpreter runs programs one by one: only one chunk per row can work there
        if splits != 1:
            raise ValueError("resident schedule off CUDA needs one chunk per row (chunk >= vocab)")
        num_groups = max(1, min(num_rows, cfg.get("num_programs") or num_rows))
    partial = torch.zeros(num_rows, splits, dtype=torch.int64, device=logits.device)
    extra = {"launch_cooperative_grid": True} if logits.is_cuda else {}
    return _grpo_resident_kernel[(num_groups * splits,)](  # the compiled kernel (registers, spills)
        logits, grad, targets, weights, behaviour, advantages, ref, row_out, partial,
        num_rows, num_groups, vocab, chunk_len, logits.stride(0), grad.stride(0),
        log2e_over_t, inv_t, eps_low, eps_high, beta,
        HAS_KL=has_kl, CHUNK=chunk, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
        num_warps=cfg["num_warps"], **extra,
    )
