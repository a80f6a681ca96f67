"""Parallelism for the learner, applied by functions (torchtitan's `parallelize.py` habit).

The policy stays a plain peft-wrapped transformers module; these functions change it in place:
  * `apply_ac`   - wraps each decoder block in a non-reentrant checkpoint wrapper;
  * `apply_compile` - torch.compile per decoder block (learner.compile);
  * `apply_fsdp` - FSDP2 `fully_shard` per decoder block, then the root, over the learner mesh;
  * `gather_full_lora` - the adapter's full tensors from the shards, under the names `lora_state`
    gives on an unsharded model (the sync's contract).

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


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a (peft-wrapped) transformers causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
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


def apply_compile(model: nn.Module) -> None:
    """torch.compile each decoder block (inductor fuses the LoRA epilogues, norms, rotary, SiLU).

    Dynamic shapes: every micro-batch has another token count. Apply after `apply_ac`, before
    `apply_fsdp` (FSDP's hooks then stay outside the compiled region, as in torchtitan)."""
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, dynamic=True)


def apply_fsdp(model: nn.Module, mesh, *, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None) -> list[nn.Module]:
    """FSDP2 per decoder block, then the root; returns the FSDP modules (root last).

    `param_dtype`/`reduce_dtype`: compute and gradient-reduction dtypes (bf16 / fp32 on GPU; None keeps
    the stored dtype, e.g. fp32 on CPU). The root stays gathered between forward and backward (FSDP2's
    default for the root); the last block too, since backward starts with it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = decoder_layers(model)
    sharded = []
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
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


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in model.parameters())


@torch.no_grad()
def gather_full_lora(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors, full (unsharded), by canonical name, sorted; a collective over the mesh.

    Every rank of the learner mesh must call it; every rank gets the full tensors (the sync needs
    them on learner rank 0). FSDP2's dim-0 shards of all adapter tensors travel in one all-gather:
    each rank's shards are padded to ceil(rows / world) rows and flattened into one buffer."""
    from torch.distributed.tensor import DTensor, Shard
    named = [(canonical_name(n), p) for n, p in model.named_parameters() if "lora_" in n]
    named.sort(key=lambda x: x[0])
    sharded = [(n, p) for n, p in named if isinstance(p, DTensor)]
    out = {n: p.detach().clone() for n, p in named if not isinstance(p, DTensor)}
    if not sharded:
        return out
    mesh = sharded[0][1].device_mesh
    world, group = mesh.size(), mesh.get_group()
    layout = []  # (name, global shape, padded rows)
    pieces = []
    for n, p in sharded:
        if len(p.placements) != 1 or p.placements[0] != Shard(0):
            out[n] = p.full_tensor()
            continue
        rows = -(-p.shape[0] // world)
        local = p.to_local()
        padded = local.new_zeros((rows, *p.shape[1:]))
        padded[:local.shape[0]] = local
        layout.append((n, p.shape, rows))
        pieces.append(padded.reshape(-1))
    send = torch.cat(pieces)
    recv = send.new_empty(world * send.numel())
    dist.all_gather_into_tensor(recv, send, group=group)
    per_rank = recv.view(world, -1)
    offset = 0
    for n, shape, rows in layout:
        numel = rows * int(torch.Size(shape[1:]).numel())
        full = per_rank[:, offset:offset + numel].reshape(world * rows, *shape[1:])
        out[n] = full[:shape[0]].clone()
        offset += numel
    return dict(sorted(out.items()))
