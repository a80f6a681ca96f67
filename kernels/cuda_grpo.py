"""The GRPO row kernel on Hopper through bulk copies: `grpo_rows_sm90.cu`, compiled at first use by NVRTC.

Role: the fused-gradient path of `triton_rows.grpo_rows` on sm_90+ with bf16 logits and 16-byte
aligned rows. The Triton row kernel stays the reference twin, the CPU (interpreter) path, the
forward-only path and the fallback for everything else. Same outputs: [N, 6] per-row terms, and
d(logits) written into `grad` (which may be the logits themselves).

Why a CUDA source: the Triton kernel reads each row twice and streams well below peak DRAM
bandwidth whatever its launch (the designs tried: profiles/HISTORY.md). Moving only the ideal
bytes needs what Triton does not expose: most of a row held on chip between the two passes (a
shared-memory ring filled by bulk copies on mbarriers, plus a few chunks in registers), with one
thread streaming the next row while the others write the gradient. NVRTC (through
`torch.cuda._compile_kernel`, which ships with PyTorch's CUDA wheels) compiles it in about a
second, with no nvcc or ninja; when it cannot, `unsupported()` says why and the caller uses Triton.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from .launch_keys import check_keys

__all__ = ["DEFAULT_CONFIG", "unsupported", "grpo_rows_bulk", "row_inputs"]

_SOURCE = Path(__file__).with_name("grpo_rows_sm90.cu")
_ROW_OUTPUTS = 6

# chunk: bf16 elements per bulk copy; slots: ring length (14 x 16 KB fills an H200's 227 KB);
# prefetch: slots never held by resident chunks (the next row streams into them); consumer_warps:
# warps that compute (the chunk must split evenly over them); reg_chunks: chunks of each row
# held in consumer registers between the passes; hints: L2 hints on the copies (chunks read twice
# evict_last, the rest evict_first). Tuned on an H200 at V=152064 (profiles/kernel.md).
DEFAULT_CONFIG = {"chunk": 8192, "slots": 14, "prefetch": 3, "consumer_warps": 16, "reg_chunks": 6, "hints": 1}


def _smem_bytes(cfg: dict) -> int:
    # ring + full/empty mbarriers + (m, s) per consumer warp for two rows + target z for two rows
    # + the row queue (4 ids, full/empty mbarriers)
    return cfg["slots"] * cfg["chunk"] * 2 + 2 * cfg["slots"] * 8 + 4 * cfg["consumer_warps"] * 4 + 8 + 4 * (8 + 8 + 4)


def unsupported(logits: torch.Tensor, grad: torch.Tensor | None, config: dict | None = None) -> str | None:
    """Why the bulk kernel cannot take this call, or None when it can. A misspelt config key raises."""
    check_keys("bulk kernel config", config or {}, list(DEFAULT_CONFIG))
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    if grad is None:
        return "forward only (the Triton row kernel reads each row once already)"
    if not logits.is_cuda or not grad.is_cuda:
        return "not CUDA tensors"
    if logits.dtype != torch.bfloat16 or grad.dtype != torch.bfloat16:
        return f"needs bf16 logits and gradient (got {logits.dtype}, {grad.dtype})"
    num_rows, vocab = logits.shape
    if vocab % 8:
        return f"vocab {vocab} is not a multiple of 8 (rows must be 16-byte aligned)"
    for name, t in (("logits", logits), ("grad", grad)):
        if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            return f"{name} rows are not 16-byte aligned (row stride {t.stride(0)}, address % 16 = {t.data_ptr() % 16})"
    if max(num_rows, logits.stride(0), grad.stride(0)) >= 2**31:
        return "sizes past int32"
    return _device_unsupported(logits.device.index or 0, tuple(sorted(cfg.items())))


@functools.lru_cache(maxsize=None)
def _device_unsupported(device_index: int, cfg_items: tuple) -> str | None:
    cfg = dict(cfg_items)
    if torch.version.hip or torch.cuda.get_device_capability(device_index) < (9, 0):
        return "needs an sm_90+ NVIDIA GPU (bulk copies and mbarrier transaction counts)"
    props = torch.cuda.get_device_properties(device_index)
    if _smem_bytes(cfg) > getattr(props, "shared_memory_per_block_optin", 0):
        return f"needs {_smem_bytes(cfg)} bytes of shared memory per block"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return "this PyTorch has no torch.cuda._compile_kernel (NVRTC)"
    try:
        _compiled(device_index, cfg_items)
    except Exception as exc:  # noqa: BLE001 - a compile failure means "use Triton", with the reason
        return f"NVRTC compile failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None


@functools.lru_cache(maxsize=None)
def _compiled(device_index: int, cfg_items: tuple):
    """(kernel, SM count, shared memory bytes, block threads) for one launch configuration."""
    cfg = dict(cfg_items)
    defines = "".join(f"#define {k.upper()} {int(v)}\n" for k, v in cfg.items())
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(defines + _SOURCE.read_text(), "grpo_rows_bulk",
                                            nvcc_options=["-std=c++17"])
        kernel.set_shared_memory_config(_smem_bytes(cfg))
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return kernel, sms, _smem_bytes(cfg), 32 * cfg["consumer_warps"] + 32


def row_inputs(logits, weights, behaviour_logprobs, advantages, ref_logprobs, beta, dlogp=None):
    """The per-row inputs as contiguous fp32 (ref stands in as a dummy when there is no KL term),
    whether the KL term is on, the given dL/dlogp (or None), and the [N, 6] fp32 output buffer.
    Shared with the Triton launch."""
    f32 = dict(dtype=torch.float32)
    has_kl = ref_logprobs is not None and beta > 0
    behaviour_logprobs = behaviour_logprobs.to(**f32).contiguous()
    ref = ref_logprobs.to(**f32).contiguous() if has_kl else behaviour_logprobs
    dlogp = None if dlogp is None else dlogp.to(**f32).contiguous()
    row_out = torch.empty(logits.shape[0], _ROW_OUTPUTS, device=logits.device, **f32)
    return (weights.to(**f32).contiguous(), behaviour_logprobs, advantages.to(**f32).contiguous(), ref, has_kl,
            dlogp, row_out)


@functools.lru_cache(maxsize=None)
def _counters(device_index: int) -> torch.Tensor:
    """[2] int32 on the device: the kernel's row counter and finished-CTA count. Zero between launches
    (the kernel's last CTA re-zeroes them), so launches on one device must not overlap in time:
    one stream at a time, as the learner runs."""
    return torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", device_index))


def grpo_rows_bulk(
    logits: torch.Tensor,              # [N, V] bf16, 16-byte aligned rows
    targets: torch.Tensor,             # [N] int
    weights: torch.Tensor,             # [N] fp32 >= 0
    behaviour_logprobs: torch.Tensor,  # [N]
    advantages: torch.Tensor,          # [N]
    ref_logprobs: torch.Tensor | None,
    grad: torch.Tensor,                # [N, V] bf16 output; may be `logits` itself
    dlogp: torch.Tensor | None = None,  # [N] dL/dlogp per row, replacing GRPO's (triton_rows.grpo_rows)
    *,
    temperature: float,
    eps_low: float,
    eps_high: float,
    beta: float,
    config: dict | None = None,
) -> torch.Tensor:                     # [N, 6] fp32 per-row outputs, as triton_rows.grpo_rows
    """Launch the bulk-copy row kernel (after `unsupported` said None). One CTA per SM, persistent."""
    num_rows, vocab = logits.shape
    weights, behaviour_logprobs, advantages, ref, has_kl, dlogp, row_out = row_inputs(
        logits, weights, behaviour_logprobs, advantages, ref_logprobs, beta, dlogp)
    if num_rows == 0:
        return row_out
    device_index = logits.device.index or 0
    kernel, sms, smem, threads = _compiled(device_index, tuple(sorted({**DEFAULT_CONFIG, **(config or {})}.items())))
    args = [logits, grad, targets.to(torch.int64).contiguous(), weights, behaviour_logprobs, advantages, ref,
            behaviour_logprobs if dlogp is None else dlogp, row_out, _counters(device_index), num_rows, vocab,
            logits.stride(0), grad.stride(0), math.log2(math.e) / temperature, 1.0 / temperature, float(eps_low),
            float(eps_high), float(beta), int(has_kl), int(dlogp is not None)]
    launch = dict(grid=(min(sms, num_rows), 1, 1), block=(threads, 1, 1), args=args, shared_mem=smem)
    if torch.cuda.current_device() == device_index:  # the launch uses the current device's stream
        kernel(**launch)
    else:
        with torch.cuda.device(device_index):
            kernel(**launch)
    return row_out
