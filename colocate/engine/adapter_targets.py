"""Where a vLLM worker writes each received adapter (`vllm_worker.ColocateWorkerExtension`): the
pinned LoRA slot (`AdapterSlot`), or the base weights it is merged into (`MergedAdapter`; on an FP8
engine `MergedFp8Adapter`), each planned from the adapter's names and shapes (`slot_plan`,
`merge_plan`).

Slot: the received buffer is cast to the engine's LoRA dtype into a staging buffer, lora_B is
scaled by alpha / r there (vLLM folds the scaling into B, `LoRALayerWeights.optimize`; doing it on a
copy keeps the received bytes intact), and one multi-tensor copy writes every A and B into the
slot's rows of the stacked `lora_a_stacked` / `lora_b_stacked` buffers.

The slot buffers are the tensors the CUDA graphs read, so nothing is re-captured. What the slot
holds is, bit for bit, what vLLM's own loader would put there for the same adapter.

Merged mode (`engine.lora_mode=merged`, the engine built without LoRA): vLLM's LoRA kernels cost
decode steps (measured in `profiles/vllm.md` and `e2e.md`), so each update is instead merged into
the base weights, W = W0 + (alpha / r) * B @ A, as TRL and OpenRLHF do before loading weights into vLLM.
`MergedAdapter` keeps W0 (a copy of every adapted weight, 12.2 GiB at 7B) and writes each fused
row block (q/k/v of `qkv_proj`, gate/up of `gate_up_proj`) with one `addmm` per projection in the
engine dtype: A and B cast to bf16, products accumulated in fp32, one final rounding of
W0 + s * B @ A. Being bf16, W cannot hold an update smaller than half a unit in the last place of
W0: early in training the sampler's policy lags the learner's by that much, and the behaviour
log-probs (which come from the sampler) carry the difference into the importance ratio. The
prefix cache is reset after every update (`VLLMEngine`). On an FP8 engine `MergedFp8Adapter` keeps
W0 in e4m3 and requantizes W0 + s * B @ A into the live weight and scale (`fp8_merge.py`).

Plain functions of tensors and names (CPU tests); vLLM itself is never imported here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from colocate.engine.fp8 import E4M3, requantize_
from colocate.engine.fp8_merge import Fp8Weight, holds, live_fp8, merge_fp32, merged_fp8_bytes, write_fp8
from colocate.wire import LoraSpec, unflatten_lora

_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class SlotTarget:
    """Where one adapter tensor goes in the pinned LoRA slot (`slot_plan`)."""
    name: str          # the adapter tensor (peft's name)
    module: str        # vLLM's LoRA module holding it (fused: qkv_proj, gate_up_proj)
    slice_index: int   # its slice of the module's stacked buffers
    is_a: bool         # lora_A, else lora_B


@dataclass(frozen=True)
class MergeTarget:
    """Where one adapted projection lives in vLLM's base weights (`merge_plan`)."""
    module: str        # vLLM's (possibly fused) linear module
    row_start: int     # the projection's first row in its weight
    row_end: int       # its last row + 1
    a_name: str        # the adapter's lora_A tensor
    b_name: str        # and its lora_B


def lora_module_name(name: str) -> tuple[str, bool]:
    """peft parameter name -> (module path as vLLM names it, is lora_A).

    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'
        -> ('model.layers.0.self_attn.q_proj', True)
    """
    body = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
    for tag, is_a in ((".lora_A.", True), (".lora_B.", False)):
        if tag in body:
            return body.split(tag)[0], is_a
    raise ValueError(f"{name!r} is not a LoRA A/B parameter name")


def slot_plan(names: list[str] | tuple[str, ...], module_names: set[str],
              packed_modules: dict[str, list[str]]) -> list[SlotTarget]:
    """Where each adapter tensor goes, in `names` order.

    vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; their LoRA wrappers keep one
    stacked buffer per original projection (slice i = packed_modules[fused][i]).
    """
    packed_index = {sub: (fused, i) for fused, subs in packed_modules.items() for i, sub in enumerate(subs)}
    plan = []
    for name in names:
        module, is_a = lora_module_name(name)
        if module in module_names:
            plan.append(SlotTarget(name, module, 0, is_a))
        elif module in packed_index:
            fused, index = packed_index[module]
            plan.append(SlotTarget(name, fused, index, is_a))
        else:
            raise KeyError(f"adapter tensor {name!r}: vLLM has no LoRA module {module!r}")
    return plan


def slot_views(lora_module, slice_index: int, slot: int, is_a: bool, shape: tuple[int, ...]) -> torch.Tensor:
    """The rows of `slot` in a LoRA layer's stacked buffer that hold one A [r, in] or B [out, r]."""
    if is_a:
        stacked = lora_module.lora_a_stacked[slice_index]          # [max_loras, 1, max_rank, in]
        view = stacked[slot, 0, :shape[0], :shape[1]]
    else:
        stacked = lora_module.lora_b_stacked[slice_index]          # [max_loras, 1, out, max_rank]
        view = stacked[slot, 0, :shape[0], :shape[1]]
    if tuple(view.shape) != tuple(shape):
        raise ValueError(f"LoRA slot view {tuple(view.shape)} does not match adapter tensor {tuple(shape)}")
    return view


class AdapterTarget(Protocol):
    """Where a worker writes each received adapter: a slot of vLLM's LoRA buffers (`AdapterSlot`)
    or the base weights it is merged into (`MergedAdapter`). The worker fills `flat` (NCCL or
    CUDA IPC), then calls `apply`; `matches` is the sync check of what the engine holds."""

    flat: torch.Tensor
    """The receive buffer: the learner's flat adapter, in its dtype (`LoraSpec`)."""

    def apply(self) -> None:
        """Write `flat` into the engine's weights."""
        ...

    def matches(self) -> bool:
        """The engine holds exactly what `apply` wrote."""
        ...


class AdapterSlot(AdapterTarget):
    """Receive buffer -> staged (engine dtype, B scaled) -> the slot's views, all on one device."""

    def __init__(self, spec: LoraSpec, destinations: list[torch.Tensor], is_a: list[bool], scaling: float,
                 shard=None):
        """`shard` (a `tp_shards.TpShard`): a tensor-parallel rank's worker, whose slot holds its slices."""
        device = destinations[0].device
        self.spec = spec
        self.scaling = float(scaling)
        self.flat = torch.zeros(spec.numel, dtype=spec.dtype, device=device)       # what the learner sent
        self.staged = torch.zeros(spec.numel, dtype=destinations[0].dtype, device=device)
        views = unflatten_lora(self.staged, spec)
        views = shard.views(views) if shard is not None else views
        self.src = [views[n] for n in spec.names]
        self.dst = list(destinations)
        self.b_src = [v for v, a in zip(self.src, is_a) if not a]

    @torch.inference_mode()
    def apply(self) -> None:
        """Write `flat` into the slot (the caller filled `flat`)."""
        self.staged.copy_(self.flat)                      # cast, as vLLM's loader does (.to(lora dtype))
        if self.scaling != 1.0:
            torch._foreach_mul_(self.b_src, self.scaling)  # then B *= alpha / r, in the engine dtype
        torch._foreach_copy_(self.dst, self.src)

    @torch.inference_mode()
    def matches(self) -> bool:
        """The slot holds exactly the staged (cast + scaled) adapter."""
        return all(torch.equal(d, s) for d, s in zip(self.dst, self.src))


def merge_plan(names: list[str] | tuple[str, ...], shapes: list[tuple[int, ...]], linear_names: set[str],
               packed: dict[str, list[str]]) -> list[MergeTarget]:
    """Where each adapted projection (an A and B pair) lives in vLLM's base model. `packed` maps a fused module's
    short name to its parts ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}, vLLM's
    `packed_modules_mapping`); a part's rows follow the parts before it, whose sizes are their B
    rows, so every part of a fused module must be adapted.
    """
    pairs: dict[str, dict[bool, tuple[str, tuple[int, ...]]]] = {}
    for name, shape in zip(names, shapes):
        module, is_a = lora_module_name(name)
        pairs.setdefault(module, {})[is_a] = (name, tuple(shape))
    part_of = {sub: (fused, i) for fused, subs in packed.items() for i, sub in enumerate(subs)}
    plan = []
    for module, ab in sorted(pairs.items()):
        if set(ab) != {True, False}:
            raise KeyError(f"LoRA module {module!r} has no {'lora_B' if True in ab else 'lora_A'} tensor")
        (a_name, _), (b_name, b_shape) = ab[True], ab[False]
        if module in linear_names:
            plan.append(MergeTarget(module, 0, b_shape[0], a_name, b_name))
            continue
        parent, _, short = module.rpartition(".")
        if short not in part_of or f"{parent}.{part_of[short][0]}" not in linear_names:
            raise KeyError(f"adapter tensor {a_name!r}: vLLM has no module {module!r} nor a fused one holding it")
        fused, index = part_of[short]
        offset = 0
        for sibling in packed[fused][:index]:
            sib = pairs.get(f"{parent}.{sibling}")
            if sib is None or False not in sib:
                raise KeyError(f"{parent}.{fused}: part {sibling!r} is not adapted, so the rows of {short!r} "
                               "are unknown (adapt every part of a fused projection)")
            offset += sib[False][1][0]
        plan.append(MergeTarget(f"{parent}.{fused}", offset, offset + b_shape[0], a_name, b_name))
    return plan


class MergedAdapter(AdapterTarget):
    """Receive buffer -> W[rows] = W0[rows] + scaling * B @ A in the engine's base weights.

    `weights` maps a module name to its weight tensor [out, in] (vLLM's, on the device)."""

    def __init__(self, spec: LoraSpec, plan: list[MergeTarget], weights: dict[str, torch.Tensor], scaling: float,
                 shard=None):
        """`shard` (a `tp_shards.TpShard`): a tensor-parallel rank's worker, whose `weights` are its
        shards and whose `plan` comes from `merge_plan` of the shard's shapes."""
        first = weights[plan[0].module]  # an adapted weight: the engine's device and dtype
        self.spec = spec
        self.scaling = float(scaling)
        self.flat = torch.zeros(spec.numel, dtype=spec.dtype, device=first.device)
        self.staged = torch.zeros(spec.numel, dtype=first.dtype, device=first.device)
        views = unflatten_lora(self.staged, spec)
        views = shard.views(views) if shard is not None else views
        used = sorted({t.module for t in plan})
        self.base = {m: weights[m].detach().clone() for m in used}    # W0, never written again
        self.ops = [(weights[t.module][t.row_start:t.row_end], self.base[t.module][t.row_start:t.row_end],
                     views[t.b_name], views[t.a_name]) for t in plan]

    @torch.inference_mode()
    def apply(self) -> None:
        """Write `flat` merged into W0 into the live weights."""
        self.staged.copy_(self.flat)                                  # to the engine dtype (bf16)
        for out, w0, b, a in self.ops:
            torch.addmm(w0, b, a, alpha=self.scaling, out=out)       # fp32 accumulate, one final rounding

    @torch.inference_mode()
    def matches(self) -> bool:
        """The live weights are exactly the merge of the staged adapter into W0."""
        return all(torch.equal(out, torch.addmm(w0, b, a, alpha=self.scaling)) for out, w0, b, a in self.ops)


class MergedFp8Adapter(AdapterTarget):
    """Receive buffer -> each adapted FP8 weight requantized from W0 (e4m3) + scaling * B @ A, with a
    new per-tensor scale, into the engine's live weight and scale (`fp8_merge.py`). `weights` maps a
    module name to its live e4m3 weight and scale (`fp8_merge.live_fp8`)."""

    def __init__(self, spec: LoraSpec, plan: list[MergeTarget], weights: dict[str, Fp8Weight], scaling: float):
        """No tensor-parallel `shard` (as `MergedAdapter` takes): vLLM scales each rank's shard of an
        FP8 weight on its own, which the memory plan and the HF emulation do not model."""
        device = weights[plan[0].module].weight.device
        self.spec = spec
        self.scaling = float(scaling)
        self.flat = torch.zeros(spec.numel, dtype=spec.dtype, device=device)
        # B @ A is added to fp32 values (`fp8_merge.merge_fp32`): staged in fp32 (the received buffer when it is)
        self.staged = self.flat if spec.dtype == torch.float32 else torch.zeros_like(self.flat, dtype=torch.float32)
        views = unflatten_lora(self.staged, spec)
        self.modules = []                                              # (live, W0, parts) per fused weight
        for name in sorted({t.module for t in plan}):
            parts = [(t.row_start, t.row_end, views[t.b_name], views[t.a_name]) for t in plan if t.module == name]
            self.modules.append((weights[name], weights[name].copy(), parts))
        largest = max(live.weight.numel() for live, _, _ in self.modules)
        self.scratch = torch.empty(largest, dtype=torch.float32, device=device)

    def requantized(self):
        """(live, x, scale) per module: the merge as its e4m3 cast takes it, each in turn in the scratch."""
        for live, base, parts in self.modules:
            x = merge_fp32(base, parts, self.scaling, self.scratch)
            yield live, x, requantize_(x)

    @torch.inference_mode()
    def apply(self) -> None:
        """Write `flat` merged into W0 into the live FP8 weights and scales."""
        if self.staged is not self.flat:
            self.staged.copy_(self.flat)
        for live, x, scale in self.requantized():
            write_fp8(x, scale, live)

    @torch.inference_mode()
    def matches(self) -> bool:
        """The live weights and scales are exactly the requantized merge of the staged adapter into W0."""
        return all(holds(x, scale, live) for live, x, scale in self.requantized())


def merged_target(spec: LoraSpec, plan: list[MergeTarget], linear: dict, scaling: float,
                  quantization: str = "none") -> tuple[int, object]:
    """Merged mode's target for vLLM's adapted `linear` modules (by name): `MergedFp8Adapter` with
    engine.quantization fp8 (every weight e4m3: vLLM's online FP8), `MergedAdapter` without (every
    weight in a float dtype of 16 bits or more) -> (the bytes it keeps beside the engine, a function
    that builds it). RuntimeError (one line) for weights the config's merge cannot write: another FP8
    kernel's layout (Marlin's repacked integers before Ada), or a checkpoint quantized already."""
    used = sorted({t.module for t in plan})
    fp8 = quantization == "fp8"

    def writable(w: torch.Tensor) -> bool:
        return w.dtype == E4M3 if fp8 else w.dtype.is_floating_point and w.element_size() >= 2
    wrong = [m for m in used if not writable(linear[m].weight)]
    if wrong:
        w = linear[wrong[0]].weight
        expected = "e4m3 weights (vLLM's online FP8)" if fp8 else "weights in the model's float dtype"
        raise RuntimeError(f"engine.lora_mode=merged with engine.quantization={quantization} writes {expected}, but "
                           f"vLLM holds {wrong[0]} as {w.dtype} {tuple(w.shape)} ({len(wrong)} of the {len(used)} "
                           "adapted modules: another kernel's layout, or a quantized checkpoint): use "
                           "engine.lora_mode=slot")
    if fp8:
        live = {m: live_fp8(linear[m]) for m in used}
        need = merged_fp8_bytes([live[m].weight.numel() for m in used])
        return need, lambda: MergedFp8Adapter(spec, plan, live, scaling)
    weights = {m: linear[m].weight for m in used}
    need = sum(w.numel() * w.element_size() for w in weights.values())
    return need, lambda: MergedAdapter(spec, plan, weights, scaling)
