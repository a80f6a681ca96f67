"""Transport: a TrajectoryBatch from an inference rank to a learner rank as packed tensors.

Wire format (point-to-point on the transport group): an int64 header
    [num_fields, (field_id, dtype_id, ndim, *shape) per field]
padded to a fixed length, then each tensor. No pickling, no per-sample messages: one header and
<= 9 tensors per shard whatever the batch size.
"""
from __future__ import annotations

from dataclasses import fields

import torch
import torch.distributed as dist

from colocate.data import TrajectoryBatch

FIELDS = [f.name for f in fields(TrajectoryBatch)]
DTYPES = [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.bool]
HEADER_LEN = 64


def encode_header(batch: TrajectoryBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tensors = batch.tensors()
    header = [len(tensors)]
    payload = []
    for name, t in tensors.items():
        header += [FIELDS.index(name), DTYPES.index(t.dtype), t.dim(), *t.shape]
        payload.append(t.contiguous())
    if len(header) > HEADER_LEN:
        raise ValueError("trajectory header too long")
    return torch.tensor(header + [0] * (HEADER_LEN - len(header)), dtype=torch.int64), payload


class PendingSend:
    """Work handles of one non-blocking send, holding its tensors alive until `wait()`."""

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        self.works, self.tensors = works, tensors

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.tensors = [], []


def send_batch(batch: TrajectoryBatch, dst: int, group) -> PendingSend:
    """Non-blocking send of one shard to global rank `dst`."""
    header, payload = encode_header(batch)
    works = [dist.isend(header, dst=dst, group=group)]
    works += [dist.isend(t, dst=dst, group=group) for t in payload]
    return PendingSend(works, [header, *payload])


def recv_batch(src: int, group) -> TrajectoryBatch:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src=src, group=group)
    h = header.tolist()
    count, pos, out = h[0], 1, {}
    for _ in range(count):
        name, dtype, ndim = FIELDS[h[pos]], DTYPES[h[pos + 1]], h[pos + 2]
        shape = h[pos + 3: pos + 3 + ndim]
        pos += 3 + ndim
        t = torch.empty(shape, dtype=dtype)
        dist.recv(t, src=src, group=group)
        out[name] = t
    return TrajectoryBatch(**out)


def shard_batch(batch: TrajectoryBatch, num_shards: int) -> list[TrajectoryBatch]:
    """Contiguous split by sequence into `num_shards` (sizes differ by at most one)."""
    n = batch.num_sequences
    bounds = [round(i * n / num_shards) for i in range(num_shards + 1)]
    return [batch.select(list(range(bounds[i], bounds[i + 1]))) for i in range(num_shards)]
