"""Parallelism for the learner, applied by functions (torchtitan's `parallelize.py` habit).

The policy stays a plain peft-wrapped transformers module; these functions change it in place:
  * `apply_ac`   - wraps each decoder block in a non-reentrant checkpoint wrapper;
  * `apply_compile` - torch.compile per decoder block (learner.compile);
  * `apply_fsdp` - FSDP2 `fully_shard` per decoder block, then the root, over the learner mesh;
  * `LoraGather` - the adapter's full tensors from the shards into one flat buffer in `LoraSpec`
    order (what the sync broadcasts), under the names `lora_state` gives on an unsharded model;
    `gather_full_lora` is its slow, obviously right reference (one `full_tensor()` per tensor).

Gradient factor: the learner's loss is normalized by global counts (tokens / sequences over all
learner ranks), so the gradient of the global loss is the SUM of the per-rank gradients. FSDP2
divides by the number of ranks by default; `apply_fsdp` sets the divide factor to 1.

Left out: tensor/context parallelism, CPU offload.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from colocate.models import canonical_name

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch's one-tensor all-gather: `all_gather_single` where it exists (torch 2.13 deprecates
`all_gather_into_tensor` with a FutureWarning on every call), the older name before."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a (peft-wrapped) transformers causal LM."""
    from peft import PeftModel
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return base.model.layers


def learner_mesh(topology):
    """1-D device mesh over the learner ranks (FSDP's shard dimension)."""
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(topology.learner_group, topology.device.type)


def apply_ac(model: nn.Module) -> None:
    """Recompute each decoder block's activations in backward (saves only the block inputs).

    Apply before `apply_fsdp`, so FSDP's hooks sit outside the recomputed region."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_compile(model: nn.Module, backend: str = "inductor", nested_breaks: bool = False) -> None:
    """torch.compile each decoder block (inductor fuses the LoRA epilogues, norms, rotary, SiLU).

    Dynamic shapes: every micro-batch has another token count. Apply after `apply_ac`, before
    `apply_fsdp` (FSDP's hooks then stay outside the compiled region, as in torchtitan). Every block
    runs the same graphs, traced once (`tests/test_learner_compile.py` counts them):
      * floats are specialized: Dynamo's default traces a module's float attributes as symbols, and
        peft's LoRA scale reaches addmm's alpha, which takes a number; every graph holding a LoRA
        projection was then traced twice, its first AOTAutograd entry abandoned, never cached;
      * the first block's input requires grad as the others' do when autograd is on
        (`_input_requires_grad`): the frozen embedding's output does not, and the `requires_grad`
        guard on it gave the first block graphs of its own (HF's `enable_input_require_grads`). Its
        backward then also runs the input-gradient GEMMs that every other block runs anyway;
      * `nested_breaks` (the tree's FlexAttention: a graph break inside every block) resumes tracing
        after the break in the frame where it happened (Dynamo's `nested_graph_breaks`), one graph
        on each side of it; else Dynamo traced every frame above it again to the break
        (transformers' wrappers, the layer, the attention), and each kept graphs of its own. Only
        there: torch 2.11's failed on the CPU's grouped varlen attention (data-dependent breaks).
    `backend`: inductor; tests count graphs with a cheaper one."""
    torch._dynamo.config.specialize_float = True
    torch._dynamo.config.nested_graph_breaks = nested_breaks
    model.get_input_embeddings().register_forward_hook(_input_requires_grad)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, dynamic=True, backend=backend)


def _input_requires_grad(module: nn.Module, args, output: torch.Tensor) -> None:
    """Forward hook on the input embeddings: their output requires grad when autograd is on (a
    gradient-free pass keeps every block's input free of it, so its graphs are shared too)."""
    if torch.is_grad_enabled():
        output.requires_grad_(True)


def apply_fsdp(model: nn.Module, mesh, *, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool = True) -> list[nn.Module]:
    """FSDP2 per decoder block, then the root; returns the FSDP modules (root last).

    `param_dtype`/`reduce_dtype`: compute and gradient-reduction dtypes (bf16 / fp32 on GPU; None keeps
    the stored dtype, e.g. fp32 on CPU). The root stays gathered between forward and backward (FSDP2's
    default for the root); the last block too, since backward starts with it; every block when
    `reshard_after_forward` is False (`learner.reshard_after_forward`: no re-gather in backward).
    Prefetch is FSDP2's implicit one (the next block's all-gather issued when the CPU reaches it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = decoder_layers(model)
    sharded = []
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(layers) - 1)
        sharded.append(layer)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    sharded.append(model)
    for module in sharded:
        # sum, not mean, over ranks: the loss already carries the global normalizers
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
        else:  # older torch
            module.set_reduce_scatter_divide_factor(1.0)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return sharded


@torch.no_grad()
def gather_full_lora(model: nn.Module) -> dict[str, torch.Tensor]:
    """Reference: the adapter's full tensors (copies) by canonical name, sorted, one `full_tensor()`
    per sharded parameter. Every rank of the learner mesh must call it. `LoraGather` is the fast
    path the sync uses; tests check the two agree."""
    from torch.distributed.tensor import DTensor
    named = sorted((canonical_name(n), p) for n, p in model.named_parameters() if "lora_" in n)
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in named}


class LoraGather:
    """The adapter's full tensors, in `LoraSpec` order, in one persistent flat buffer.

    FSDP2 holds dim-0 shards (torch.chunk rows: ceil(rows / world) per rank, the last ranks fewer or
    none). Per call: one multi-tensor copy of the local shards into a padded send buffer, one
    all-gather over the learner mesh, one multi-tensor copy from the gathered [world, shard] layout
    into the flat buffer; unsharded parameters are copied straight in. Every buffer and copy list is
    built once: rebuilding them per step (hundreds of tensors at 7B: pad, cat, slice, clone) cost
    tens of milliseconds a step.

    Every learner rank calls it; every rank gets the flat buffer. The result is overwritten by the
    next call (the sender broadcasts it on the same stream first)."""

    def __init__(self, model: nn.Module):
        from torch.distributed.tensor import DTensor, Shard
        from colocate.wire import LoraSpec, unflatten_lora
        named = sorted((canonical_name(n), p) for n, p in model.named_parameters() if "lora_" in n)
        self.spec = LoraSpec.of(dict(named))                   # global shapes (DTensor.shape)
        local = [p.to_local() if isinstance(p, DTensor) else p for _, p in named]
        self.flat = torch.empty(self.spec.numel, dtype=self.spec.dtype, device=local[0].device)
        full = unflatten_lora(self.flat, self.spec)
        plain = [(n, p) for n, p in named if not isinstance(p, DTensor)]
        self._plain_src, self._plain_dst = [p for _, p in plain], [full[n] for n, _ in plain]
        sharded = [(n, p) for n, p in named if isinstance(p, DTensor)]
        self._sharded, self._send_dst, self._out_src, self._out_dst = [], [], [], []
        self.group = None
        if not sharded:
            return
        mesh = sharded[0][1].device_mesh
        world, self.group = mesh.size(), mesh.get_group()
        # sizes from shapes only: indexing a DTensor (p[0]) would be an all-gather
        rows_of = {n: -(-p.shape[0] // world) for n, p in sharded}
        inner_of = {n: int(torch.Size(p.shape[1:]).numel()) for n, p in sharded}
        per_rank = sum(rows_of[n] * inner_of[n] for n, _ in sharded)  # padded shard elements per rank
        self.send = torch.zeros(per_rank, dtype=self.spec.dtype, device=self.flat.device)
        self.recv = torch.empty(world, per_rank, dtype=self.spec.dtype, device=self.flat.device)
        offset = 0
        for n, p in sharded:
            if len(p.placements) != 1 or p.placements[0] != Shard(0):
                raise ValueError(f"{n}: LoraGather handles FSDP2's Shard(0) on a 1-D mesh, got {p.placements}")
            rows, tail, inner = rows_of[n], tuple(p.shape[1:]), inner_of[n]
            mine = p.to_local().shape[0]
            if mine:
                self._sharded.append(p)
                self._send_dst.append(self.send[offset:offset + mine * inner].view(mine, *tail))
            for r in range(world):
                lo, hi = r * rows, min((r + 1) * rows, p.shape[0])
                if hi > lo:
                    self._out_src.append(self.recv[r, offset:offset + (hi - lo) * inner].view(hi - lo, *tail))
                    self._out_dst.append(full[n][lo:hi])
            offset += rows * inner

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        """-> [numel] full adapter in spec order (a collective when sharded)."""
        if self._plain_src:
            torch._foreach_copy_(self._plain_dst, self._plain_src)
        if self.group is not None:
            # to_local() under no_grad is the live local tensor (FSDP2 may swap it at lazy init)
            if self._sharded:
                torch._foreach_copy_(self._send_dst, [p.to_local() for p in self._sharded])
            all_gather_single(self.recv.view(-1), self.send, group=self.group)
            torch._foreach_copy_(self._out_dst, self._out_src)
        return self.flat
