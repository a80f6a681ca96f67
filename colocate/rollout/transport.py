"""Transport: a TrajectoryBatch from an inference rank to a learner rank as packed tensors.

Wire format (point-to-point on the transport group): an int64 header
    [num_fields, (field_id, dtype_id, ndim, *shape) per field, 0..., flags]
padded to a fixed length, then each tensor. `flags` (the last header word) carries run control
from the inference rank (FLAG_STOP: a stop was requested there). No pickling, no per-sample messages: one header and
<= 9 tensors per shard whatever the batch size.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import fields

import torch
import torch.distributed as dist

from colocate.data import TrajectoryBatch

FIELDS = [f.name for f in fields(TrajectoryBatch)]
DTYPES = [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.bool]
HEADER_LEN = 64
FLAG_STOP = 2


def encode_header(batch: TrajectoryBatch, flags: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tensors = batch.tensors()
    header = [len(tensors)]
    payload = []
    for name, t in tensors.items():
        header += [FIELDS.index(name), DTYPES.index(t.dtype), t.dim(), *t.shape]
        payload.append(t.contiguous())
    if len(header) > HEADER_LEN - 1:
        raise ValueError("trajectory header too long")
    return torch.tensor(header + [0] * (HEADER_LEN - 1 - len(header)) + [flags], dtype=torch.int64), payload


class TrajectorySender:
    """Sends batches from a background thread, so sampling goes on while learners receive.

    Blocking sends in one thread rather than `isend` handles kept by the caller: gloo isend work
    objects created under torch.profiler and freed after it stopped crashed the process (torch 2.13,
    reproduced standalone). `wait_through(k)` blocks until every send of batches <= k is done.
    """

    def __init__(self, group, first_index: int = 0):
        self.group = group
        self._queue: queue.Queue = queue.Queue()
        self._done = first_index - 1  # a resumed run starts past batches it never sends
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="colocate-trajectory-sender", daemon=True)
        self._thread.start()

    def submit(self, index: int, shards: list[tuple[TrajectoryBatch, int]], flags: int = 0) -> None:
        """Queue batch `index` as (shard, destination rank) pairs."""
        self._queue.put((index, shards, flags))

    def in_flight(self, submitted_through: int) -> int:
        """Batches submitted (through `submitted_through`) but not yet taken by the learners."""
        with self._cond:
            return submitted_through - self._done

    def wait_through(self, index: int) -> None:
        with self._cond:
            while self._done < index and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError(f"trajectory send failed: {self._error}") from self._error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"trajectory send failed: {self._error}") from self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            index, shards, flags = item
            try:
                for batch, dst in shards:
                    header, payload = encode_header(batch, flags)
                    for t in (header, *payload):
                        dist.send(t, dst=dst, group=self.group)
            except BaseException as e:  # a dead peer: surface it in the main thread
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._done = index
                self._cond.notify_all()


def send_batch(batch: TrajectoryBatch, dst: int, group, flags: int = 0) -> None:
    """Blocking send of one shard to global rank `dst` (tests and simple callers)."""
    header, payload = encode_header(batch, flags)
    for t in (header, *payload):
        dist.send(t, dst=dst, group=group)


def recv_batch(src: int, group) -> TrajectoryBatch:
    return recv_batch_with_flags(src, group)[0]


def recv_batch_with_flags(src: int, group) -> tuple[TrajectoryBatch, int]:
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
    return TrajectoryBatch(**out), h[-1]


CONTROL_TAG = 7  # control messages never match a trajectory receive, whatever is in flight


def send_json(data: dict, dst: int, group) -> None:
    """Small control payloads (an inference rank's checkpoint state): length, then UTF-8 bytes."""
    import json
    raw = torch.frombuffer(bytearray(json.dumps(data).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([raw.numel()], dtype=torch.int64), dst=dst, group=group, tag=CONTROL_TAG)
    dist.send(raw, dst=dst, group=group, tag=CONTROL_TAG)


def recv_json(src: int, group) -> dict:
    import json
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src=src, group=group, tag=CONTROL_TAG)
    raw = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(raw, src=src, group=group, tag=CONTROL_TAG)
    return json.loads(bytes(raw.tolist()).decode())


def shard_batch(batch: TrajectoryBatch, num_shards: int) -> list[TrajectoryBatch]:
    """Contiguous split by sequence into `num_shards` (sizes differ by at most one)."""
    n = batch.num_sequences
    bounds = [round(i * n / num_shards) for i in range(num_shards + 1)]
    return [batch.select(list(range(bounds[i], bounds[i + 1]))) for i in range(num_shards)]
