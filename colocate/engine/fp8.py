"""FP8 sampling emulated in the HF reference engine (`engine.quantization: fp8`): what vLLM's online
FP8 does to a bf16 checkpoint, in the model's own dtype, on any device, so the learner's correction
of an FP8 engine (TIS / MIS against the sampler's log-probs) and the canary's FP8 bound run on CPU.

vLLM (`quantization="fp8"` on an unquantized checkpoint: `Fp8PerTensorOnlineLinearMethod`) rounds
every linear layer's weight of the decoder blocks to float8 e4m3 once at load, with one scale per
weight tensor, amax / 448 (e4m3's largest finite value); q, k and v are one fused weight there, and
gate and up another, so each group shares one scale (`FUSED`). At every call it rounds the layer's
input to e4m3 too, with a scale per token (amax of the row / 448: cutlass's per-token dynamic scales,
what Hopper takes; GPUs without cutlass FP8 use one scale per input tensor), and multiplies the two
with fp32 accumulation. The embeddings and the LM head stay in the model's dtype, and so does a LoRA
adapter (vLLM's punica kernels read the unrounded input beside the FP8 base GEMM).

Here: each base weight is rounded through `torch.float8_e4m3fn` in place (the engine's own copy:
the learner keeps full precision), and a forward pre-hook rounds each base linear's input per row;
the products then run in the model's dtype: beside an FP8 GEMM's fp32 accumulation that adds the
model dtype's own roundings (of the rounded values and of the sums), which the canary's bound counts
already as the compute dtype's error. The adapter's `lora_A` / `lora_B` see the unrounded input (peft
calls `base_layer` with it and the adapter beside it), as vLLM's slot mode does.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
"""448: the largest finite e4m3 value; a tensor's scale maps its amax onto it."""

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections vLLM loads into one weight (QKVParallelLinear, MergedColumnParallelLinear): one scale."""


def round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x through e4m3 at `scale` (broadcast over x) and back, in x's dtype: x / scale is rounded to
    e4m3's nearest value (3 mantissa bits), saturated at +-448, then multiplied back."""
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return (q.float() * scale).to(x.dtype)


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 in fp32, never 0 (an all-zero tensor or row keeps the scale of the smallest normal)."""
    return (amax.float() / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """A linear layer's input [..., in] through e4m3 with one dynamic scale per token (row)."""
    return round_trip(x, amax_scale(x.abs().amax(dim=-1, keepdim=True)))


def _input_hook(module, args):
    return (round_rows(args[0]), *args[1:])


def base_linears(model) -> dict[str, torch.nn.Linear]:
    """The decoder blocks' linear layers vLLM quantizes, by name without peft's `.base_layer`: every
    `nn.Linear` inside `.layers.` but the adapter's own (lora_A / lora_B)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name and "lora_" not in name:
            out[name.replace(".base_layer", "")] = module
    return out


def scale_groups(names) -> list[list[str]]:
    """The linears that share one weight scale: a block's q, k, v and its gate, up (`FUSED`)."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name in sorted(names):
        parent, _, leaf = name.rpartition(".")
        fused = next((i for i, group in enumerate(FUSED) if leaf in group), None)
        groups.setdefault((parent, fused) if fused is not None else (name, -1), []).append(name)
    return list(groups.values())


@torch.no_grad()
def emulate_fp8(model) -> int:
    """Round the base linear weights of `model` (the engine's copy) to e4m3 in place, per tensor or
    fused group, and hook their inputs to be rounded per token at every call -> how many linears."""
    linears = base_linears(model)
    for group in scale_groups(linears):
        scale = amax_scale(torch.stack([linears[n].weight.abs().amax() for n in group]).amax())
        for name in group:
            weight = linears[name].weight
            weight.copy_(round_trip(weight, scale))
            linears[name].register_forward_pre_hook(_input_hook)
    return len(linears)
