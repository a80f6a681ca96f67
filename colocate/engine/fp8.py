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

With `engine.lora_mode: merged` vLLM's worker merges the adapter into the FP8 weights instead
(`adapter_targets.MergedFp8Adapter`): each adapted weight becomes W0 + scaling * B @ A rounded through
e4m3 again, at a new scale per fused weight, at every update. `merged_fp8_base` and `merge_fp8`
emulate that: the peft adapter layers are switched off (the update lives in the weights) and each
load requantizes the adapted groups from their rounded W0.

The rounding rule is vLLM's (`to_e4m3`), the one both engines use: x times the fp32 reciprocal of
its scale, saturated at +-448, cast to e4m3 (nearest, ties to even), for the weights at load and
for the inputs in the compiled model.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
"""448: the largest finite e4m3 value; a tensor's scale maps its amax onto it."""

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections vLLM loads into one weight (QKVParallelLinear, MergedColumnParallelLinear): one scale."""


def saturate_scaled(x: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x times the fp32 reciprocal of `scale`, saturated at +-448: what vLLM casts to e4m3, the
    weights' per-tensor kernel at load (`scaled_fp8_quant`) and the inputs' per-token quantization in
    the compiled model (`QuantFP8.forward_native`; its CUDA kernel, under enforce_eager only,
    divides instead, which differs in fp32's last bit now and then). `out` (fp32, x's shape; x
    itself) takes it in place."""
    y = torch.mul(x.float(), scale.float().reciprocal(), out=out)
    return y.clamp_(-E4M3_MAX, E4M3_MAX)


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x at `scale` (broadcast over x) rounded to e4m3's nearest value, ties to even (3 mantissa bits)."""
    return saturate_scaled(x, scale).to(E4M3)


def round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x through e4m3 at `scale` and back, in x's dtype (`to_e4m3`, then multiplied back)."""
    return (to_e4m3(x, scale).float() * scale).to(x.dtype)


MIN_INPUT_SCALE = 1.0 / (E4M3_MAX * 512)
"""The smallest per-token scale of an input (vLLM's `_FP8_MIN_SCALING_FACTOR`)."""


def amax_scale(amax: torch.Tensor, floor: float = torch.finfo(torch.float32).tiny) -> torch.Tensor:
    """amax / 448 in fp32 (vLLM's dynamic scale), never under `floor`: an all-zero weight keeps the
    smallest normal (where vLLM's per-tensor kernel would divide by 0), an input row vLLM's
    `MIN_INPUT_SCALE`. Divided by a tensor on amax's device: CUDA turns a division by a Python number
    into a multiplication by its rounded reciprocal, a bit away from vLLM's kernel now and then."""
    return (amax.float() / torch.full((), E4M3_MAX, device=amax.device)).clamp(min=floor)


def requantize_(x: torch.Tensor) -> torch.Tensor:
    """vLLM's dynamic per-tensor scale of fp32 `x` (amax / 448), and x turned in place into the
    values its e4m3 cast takes (scaled and saturated: `saturate_scaled`) -> the scale, 0-dim."""
    low, high = torch.aminmax(x)                           # no |x| temporary the size of x
    scale = amax_scale(torch.maximum(high, -low))
    saturate_scaled(x, scale, out=x)
    return scale


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """A linear layer's input [..., in] through e4m3 with one dynamic scale per token (row)."""
    return round_trip(x, amax_scale(x.abs().amax(dim=-1, keepdim=True), MIN_INPUT_SCALE))


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


def merged_fp8_base(model) -> dict[str, torch.Tensor]:
    """Turn `model` (emulated FP8, `emulate_fp8`) to lora_mode merged: peft's adapter layers off, so
    the base weights alone carry the adapter (`merge_fp8` writes it in) -> a copy of the rounded W0
    of every group (`scale_groups`) with an adapted linear, by name."""
    linears = base_linears(model)
    adapted = {n for n in linears if hasattr(model.get_submodule(n), "lora_A")}
    model.base_model.disable_adapter_layers()
    return {n: linears[n].weight.detach().clone() for group in scale_groups(linears)
            if adapted.intersection(group) for n in group}


@torch.no_grad()
def merge_fp8(model, base: dict[str, torch.Tensor]) -> None:
    """Each group of `base` requantized with the adapter merged, as vLLM's merged FP8 sync does:
    W0 + scaling * B @ A in fp32 (a linear without an adapter: W0), the group's rows stacked as vLLM
    fuses them, one new scale (`requantize_`), rounded through e4m3 into the model's weights."""
    linears = base_linears(model)
    for group in scale_groups(base):
        x = torch.cat([merged_fp32(model.get_submodule(n), base[n]) for n in group])
        scale = requantize_(x)
        for name, rows in zip(group, x.split([linears[n].weight.shape[0] for n in group])):
            weight = linears[name].weight
            weight.copy_((rows.to(E4M3).float() * scale).to(weight.dtype))


def merged_fp32(layer, w0: torch.Tensor) -> torch.Tensor:
    """W0 + scaling * B @ A of a peft LoRA layer's active adapters, in fp32 (W0 alone without one)."""
    out = w0.float()
    for name in getattr(layer, "active_adapters", ()):
        out = torch.addmm(out, layer.lora_B[name].weight.float(), layer.lora_A[name].weight.float(),
                          alpha=layer.scaling[name])
    return out
