"""Adapter sync: LoRA tensors -> one flat buffer -> broadcast on the sync group -> engine.load_lora.

The sync group holds learner rank 0 (the source) and every inference rank. Each update is two
broadcasts: an int64 header [version, numel, checksum, flags] then the flat buffer. `flags` carries
run-control bits to every inference rank at no extra message (FLAG_CHECKPOINT: send your state for
a checkpoint; FLAG_STOP: stop after this version). Both sides build the
same `LoraSpec` from their own model (same config, same sorted names), so no names or shapes cross
the wire. The checksum is an exact integer hash of the buffer's bytes, so a receiver can prove it
holds the learner's weights bit for bit.

Left out: the vLLM child-process path (a worker extension + stateless NCCL group), which lives with
the vLLM engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


FLAG_CHECKPOINT = 1
FLAG_STOP = 2


@dataclass(frozen=True)
class LoraSpec:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @staticmethod
    def of(tensors: dict[str, torch.Tensor]) -> "LoraSpec":
        names = tuple(sorted(tensors))
        dtypes = {tensors[n].dtype for n in names}
        if len(dtypes) != 1:
            raise ValueError(f"adapter tensors must share one dtype, got {dtypes}")
        return LoraSpec(names, tuple(tuple(tensors[n].shape) for n in names), dtypes.pop())

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)


def flatten_lora(tensors: dict[str, torch.Tensor] | torch.Tensor, spec: LoraSpec,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Adapter tensors -> [numel] buffer in spec order (written into `out` when given). A tensor is
    taken as already flat (`LoraGather`'s output) and returned as is."""
    if isinstance(tensors, torch.Tensor):
        if tensors.shape != (spec.numel,) or tensors.dtype != spec.dtype:
            raise ValueError(f"flat adapter {tuple(tensors.shape)} {tensors.dtype} is not the spec's "
                             f"({spec.numel},) {spec.dtype}")
        return tensors
    if out is None:
        out = torch.empty(spec.numel, dtype=spec.dtype, device=next(iter(tensors.values())).device)
    offset = 0
    for name, shape in zip(spec.names, spec.shapes):
        n = int(torch.Size(shape).numel())
        out[offset:offset + n].copy_(tensors[name].detach().reshape(-1))
        offset += n
    return out


def unflatten_lora(flat: torch.Tensor, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """[numel] buffer -> views by name (no copies)."""
    out, offset = {}, 0
    for name, shape in zip(spec.names, spec.shapes):
        n = int(torch.Size(shape).numel())
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out


def checksum(flat: torch.Tensor) -> int:
    """Exact hash of the buffer's bytes (order-sensitive, wraps in int64)."""
    words = flat.detach().contiguous().view(torch.uint8).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device) % 65521
    return int((words * weights).sum())


def broadcast_lora(tensors: dict[str, torch.Tensor] | torch.Tensor, spec: LoraSpec, version: int, *, src: int, group,
                   with_checksum: bool = False, buffer: torch.Tensor | None = None, flags: int = 0) -> float:
    """Learner rank 0: send `tensors` (by name, or already flat) as `version`. Returns seconds spent."""
    import time
    t0 = time.perf_counter()
    flat = flatten_lora(tensors, spec, buffer)
    header = torch.tensor([version, spec.numel, checksum(flat) if with_checksum else 0, flags],
                          dtype=torch.int64, device=flat.device)
    dist.broadcast(header, src=src, group=group)
    dist.broadcast(flat, src=src, group=group)
    return time.perf_counter() - t0


def receive_lora(spec: LoraSpec, *, src: int, group, device, buffer: torch.Tensor | None = None,
                 ) -> tuple[int, dict[str, torch.Tensor], int, int]:
    """Inference rank: -> (version, tensors (views of the buffer), checksum sent (0 if none), flags)."""
    header = torch.zeros(4, dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    version, numel, sent_sum, flags = (int(v) for v in header.tolist())
    if numel != spec.numel:
        raise RuntimeError(f"adapter size mismatch: learner sent {numel} elements, this rank expects "
                           f"{spec.numel}; the lora config differs between roles")
    flat = buffer if buffer is not None else torch.empty(numel, dtype=spec.dtype, device=device)
    dist.broadcast(flat, src=src, group=group)
    if sent_sum and checksum(flat) != sent_sum:
        raise RuntimeError(f"adapter version {version} arrived corrupted (checksum mismatch)")
    return version, unflatten_lora(flat, spec), sent_sum, flags
