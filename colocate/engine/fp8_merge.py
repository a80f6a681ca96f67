"""The adapter merged into an FP8 engine's weights (`engine.quantization: fp8` with `engine.lora_mode:
merged`): the arithmetic `adapter_targets.MergedFp8Adapter` runs at each sync, as plain functions of
tensors (tested on CPU), and the one function that knows how vLLM stores an FP8 linear.

vLLM's online FP8 (`Fp8PerTensorOnlineLinearMethod`) rounds each linear's bf16 weight to e4m3 at
load, one scale for the whole weight (a fused qkv_proj or gate_up_proj has one), and frees the bf16
one. So W0 is kept as that e4m3 weight and its scale (a copy: one byte a parameter), and each sync
rebuilds every adapted weight from it:

    x = W0q * s0;  x[rows of each part] += scaling * B @ A;  s = amax|x| / 448;  W = e4m3(x / s)

then writes W and s into the live tensors, which the CUDA graphs and the compiled graph read. x is
fp32, in one scratch buffer sized for the largest weight: e4m3 values times an fp32 scale are held
to 2^-24, and the update is added without a rounding of its own, so the one rounding of the merge is
e4m3's (bf16 would round x first, at 1/16 of e4m3's step, before the rounding that decides which
updates show). The scale and the rounding are vLLM's dynamic per-tensor rule (`fp8.requantize_`),
what `ops.scaled_fp8_quant(x, scale=None)` does at load; the HF engine's emulation uses it too.

The rounding's cost: the sampler's weights move only where W0 + scaling * B @ A crosses a midpoint
of e4m3's grid (3 mantissa bits), so an update smaller than that leaves a weight where it was, and
the sampler lags the learner by more than bf16's merge; the loss's correction (TIS / MIS) weighs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from colocate.engine.fp8 import E4M3

SCRATCH_BYTES = 4
"""Bytes per element of the scratch buffer a merge is computed in (fp32)."""


@dataclass(frozen=True)
class Fp8Weight:
    """An e4m3 weight [out, in] and its per-tensor scale [1] (fp32)."""
    weight: torch.Tensor
    scale: torch.Tensor

    def copy(self) -> "Fp8Weight":
        """A contiguous copy of both (W0: never written again)."""
        return Fp8Weight(self.weight.clone(memory_format=torch.contiguous_format), self.scale.clone())


def live_fp8(layer) -> Fp8Weight:
    """The tensors vLLM's FP8 GEMM reads for one linear layer, as views of the live ones. After
    loading (`Fp8PerTensorOnlineLinearMethod` then the cutlass kernel's
    `process_weights_after_loading`) `weight` is the transposed [in, out] view of an [out, in] e4m3
    tensor, both sizes zero-padded to multiples of 16 where they are not; `weight_scale` holds one
    fp32 scale. -> the logical [:out, :in] rows of the untransposed tensor, and the scale."""
    weight, scale = layer.weight, getattr(layer, "weight_scale", None)
    out, inp = layer.output_size_per_partition, layer.input_size_per_partition
    if weight.dtype != E4M3 or scale is None or scale.numel() != 1 or scale.dtype != torch.float32:
        raise RuntimeError(f"engine.lora_mode=merged with engine.quantization=fp8: an FP8 linear holds "
                           f"{weight.dtype} {tuple(weight.shape)} weights and a scale of "
                           f"{None if scale is None else tuple(scale.shape)}, not vLLM's per-tensor e4m3 "
                           "layout this merge writes: use engine.lora_mode=slot")
    rows = weight.t()[:out, :inp]
    if rows.shape != (out, inp) or rows.stride(1) != 1:
        raise RuntimeError(f"engine.lora_mode=merged with engine.quantization=fp8: an FP8 weight of "
                           f"{tuple(weight.shape)} is not the transpose of an [out, in] = [{out}, {inp}] "
                           "tensor: use engine.lora_mode=slot")
    return Fp8Weight(rows, scale)


def merge_fp32(base: Fp8Weight, parts, scaling: float, scratch: torch.Tensor) -> torch.Tensor:
    """W0q * s0 with scaling * B @ A added to each part's rows, in fp32, in `scratch` (-> the view
    of it that holds the [out, in] result). `parts`: (first row, last row + 1, B [rows, r], A [r, in])
    in fp32."""
    x = scratch[:base.weight.numel()].view(base.weight.shape)
    x.copy_(base.weight)                                   # e4m3 -> fp32, exact
    x.mul_(base.scale)
    for start, end, b, a in parts:
        x[start:end].addmm_(b, a, alpha=scaling)
    return x


def write_fp8(x: torch.Tensor, scale: torch.Tensor, live: Fp8Weight) -> None:
    """`requantize_`'s result into the live weight and scale, in place (the graphs hold those tensors)."""
    live.weight.copy_(x)                                   # fp32 -> e4m3: nearest, ties to even
    live.scale.copy_(scale.reshape(live.scale.shape))


def holds(x: torch.Tensor, scale: torch.Tensor, live: Fp8Weight) -> bool:
    """The live weight and scale are bit for bit what `write_fp8` writes of x and scale."""
    return (torch.equal(live.scale, scale.reshape(live.scale.shape))
            and torch.equal(live.weight.view(torch.uint8), x.to(E4M3).view(torch.uint8)))


FP8_CAPABILITY = (8, 9)
"""The compute capability of FP8 tensor cores (Ada 8.9, Hopper 9.0). Before it vLLM's online FP8
repacks the weights for weight-only kernels, a layout this merge does not write."""


def check_fp8_device(cfg, gpus: int) -> None:
    """ConfigError where the config merges into FP8 weights (engine.quantization=fp8,
    engine.lora_mode=merged) and GPU 0 has no FP8 tensor cores (NVML; nothing to read: no check), so
    the engine's start would stop at its build (`merged_target`)."""
    from colocate.config_checks import ConfigError
    from colocate.nvml import capability
    if cfg.engine.quantization != "fp8" or cfg.engine.lora_mode != "merged" or not gpus:
        return
    facts = capability(0)
    if facts is not None and facts[1:] < FP8_CAPABILITY:
        name, major, minor = facts
        raise ConfigError(f"engine.quantization=fp8 with engine.lora_mode=merged needs FP8 tensor cores (compute "
                          f"capability 8.9 or more: Ada, Hopper); GPU 0 is {name} ({major}.{minor}): set "
                          "engine.quantization=none")


def fp8_copy_bytes(params: int, largest: int) -> int:
    """The memory merged FP8 keeps beside the engine: W0 in e4m3 (one byte a parameter) for `params`
    parameters, and the fp32 scratch the largest fused weight (`largest` elements) is requantized in.
    The memory plan gives it the shape's figures (`gpu_budget.merged_copy_bytes`), the engine's build
    the adapter's own (`merged_fp8_bytes`)."""
    return params + SCRATCH_BYTES * largest


def merged_fp8_bytes(sizes: list[int]) -> int:
    """`fp8_copy_bytes` for weights of `sizes` elements."""
    return fp8_copy_bytes(sum(sizes), max(sizes, default=0))
