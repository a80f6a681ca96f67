"""What crosses between the roles, and how: one module below both the rollout and the learner.

Adapter (learner rank 0 -> every inference rank, through an `AdapterChannel`): the LoRA tensors
flattened into one [numel] buffer in `LoraSpec` order, preceded by an int64 header
[version, numel, checksum, flags]. Both sides build the same `LoraSpec` from their own model
(same config, same sorted names), so no names or shapes cross the wire. The checksum is an exact
integer hash of the buffer's bytes (0: not sent), so a receiver can prove it holds the learner's
weights bit for bit.

Trajectories (each inference rank -> each learner, point to point on the gloo transport group): an
int64 header [num_fields, (field_id, dtype_id, ndim, *shape) per field, 0..., probe length, probe
version + 1, flags] padded to a fixed length, then each tensor of the `TrajectoryBatch`, then (when
the probe version slot is not 0) the engine's canary score of the version that sampled the batch
(`ProbeScore`, `colocate.canary`). No pickling, no per-sample messages.

Run control rides on both headers (`RunFlags`): a stop requested on an inference rank reaches the
learners in the trajectory header; the learners' checkpoint and stop decisions reach every
inference rank in the adapter header. No extra collective, so all ranks stop after the same step.
Small JSON control messages (an inference rank's resume state) use their own tag.
"""
from __future__ import annotations

import enum
import json
import queue
import threading
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from colocate.data import TrajectoryBatch


class RunFlags(enum.IntFlag):
    NONE = 0
    CHECKPOINT = 1
    """Learners -> inference ranks: send your sampler/env state for the checkpoint of this version."""
    STOP = 2
    """Stop after this step (a signal was seen on some rank)."""


# ---------------------------------------------------------------------------------- adapter

@dataclass(frozen=True)
class LoraSpec:
    """The adapter's layout on the wire: names (sorted), shapes, one dtype."""
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
    taken as already flat (`LoraGather`'s output) and returned as is, after a layout check."""
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


def checksum(flat: torch.Tensor, chunk_bytes: int = 1 << 26) -> int:
    """Exact hash of the buffer's bytes: sum of byte * (position % 65521), wrapping in int64.

    Computed in chunks so the temporaries stay bounded (16 bytes per byte of adapter otherwise,
    gigabytes at 7B inside a vLLM worker whose memory is budgeted); integer sums do not depend on
    the chunking."""
    words = flat.detach().contiguous().view(torch.uint8).view(-1)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), chunk_bytes):
        part = words[start:start + chunk_bytes].to(torch.int64)
        weights = torch.arange(start + 1, start + part.numel() + 1, dtype=torch.int64, device=words.device) % 65521
        total += (part * weights).sum()
    return int(total)


ADAPTER_HEADER_NUMEL = 4


def adapter_header(version: int, spec: LoraSpec, flat: torch.Tensor | None, flags: int) -> torch.Tensor:
    """[4] int64 on the CPU: [version, numel, checksum of `flat` (0 when None), flags]."""
    return torch.tensor([version, spec.numel, checksum(flat) if flat is not None else 0, int(flags)],
                        dtype=torch.int64)


@dataclass(frozen=True)
class AdapterHeader:
    version: int
    checksum: int
    """0: the sender did not compute one."""
    flags: RunFlags


def parse_adapter_header(header: torch.Tensor, spec: LoraSpec) -> AdapterHeader:
    version, numel, sent_sum, flags = (int(v) for v in header.tolist())
    if numel != spec.numel:
        raise RuntimeError(f"adapter size mismatch: learner sent {numel} elements, this rank expects "
                           f"{spec.numel}; the lora config differs between roles")
    return AdapterHeader(version, sent_sum, RunFlags(flags))


# ---------------------------------------------------------------------------------- CUDA IPC

def share_cuda_buffer(buffer: torch.Tensor) -> dict:
    """A CUDA tensor's IPC description, JSON-able (bytes as hex): what another process on the same
    GPU needs to map the same memory (`open_cuda_buffer`). The owner keeps `buffer` alive."""
    if not buffer.is_cuda or not buffer.is_contiguous() or buffer.storage_offset() != 0:
        raise ValueError("share_cuda_buffer: needs a contiguous CUDA tensor that owns its storage start")
    (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = \
        buffer.untyped_storage()._share_cuda_()
    return {"handle": handle.hex(), "storage_bytes": int(size), "storage_offset": int(offset),
            "ref_handle": ref_handle.hex(), "ref_offset": int(ref_offset), "event_handle": event_handle.hex(),
            "event_sync": bool(event_sync), "shape": list(buffer.shape), "dtype": str(buffer.dtype).removeprefix("torch.")}


def open_cuda_buffer(desc: dict, device: torch.device) -> torch.Tensor:
    """Map a buffer shared by `share_cuda_buffer` in another process. `device` is this process's
    index of the same physical GPU (a vLLM worker sees its GPU as cuda:0 whatever the learner's index)."""
    storage = torch.UntypedStorage._new_shared_cuda(
        torch.device(device).index or 0, bytes.fromhex(desc["handle"]), desc["storage_bytes"], desc["storage_offset"],
        bytes.fromhex(desc["ref_handle"]), desc["ref_offset"], bytes.fromhex(desc["event_handle"]), desc["event_sync"])
    dtype, shape = getattr(torch, desc["dtype"]), desc["shape"]
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, torch.empty(shape, device="meta").stride())


def broadcast_json(obj, *, src: int, group, rank: int):
    """One JSON value from `src` to every rank of `group` (two CPU broadcasts: length, UTF-8 bytes);
    `obj` is read on `src` only. For gloo groups (CPU tensors)."""
    data = json.dumps(obj).encode() if rank == src else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == src else \
        torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(raw, src=src, group=group)
    return json.loads(bytes(raw.tolist()).decode())


# ---------------------------------------------------------------------------------- trajectories

FIELDS = [f.name for f in fields(TrajectoryBatch)]
DTYPES = [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.bool]
HEADER_LEN = 64
HEADER_TAIL = 4
"""The header's last slots: the inference rank's busy share in permille + 1 (0: not known), probe
length, probe version + 1 (0: no probe score follows), flags."""


@dataclass(frozen=True)
class ProbeScore:
    """An engine's canary: its log-probs of the fixed probe under the adapter version it holds."""
    version: int
    logprobs: torch.Tensor
    """[T-1] float32, log p(probe[t] | probe[:t]) for t = 1..T-1 (temperature 1, no mask)."""


@dataclass
class Shard:
    """One inference rank's part of a batch for one learner, as received."""
    batch: TrajectoryBatch
    flags: RunFlags
    """The inference rank's run control (a stop it saw)."""
    canary: ProbeScore | None = None
    """The engine's probe score of the version that sampled this batch, when it is scored first."""
    busy: float | None = None
    """The inference rank's share of the interval since its previous batch spent collecting this one
    (the step line's `inf` busy); None for its first batch."""


def encode_batch(batch: TrajectoryBatch, flags: int = 0, canary: ProbeScore | None = None,
                 busy: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """-> ([HEADER_LEN] int64 header, the tensors to send after it)."""
    tensors = batch.tensors()
    header = [len(tensors)]
    payload = []
    for name, t in tensors.items():
        header += [FIELDS.index(name), DTYPES.index(t.dtype), t.dim(), *t.shape]
        payload.append(t.contiguous())
    if len(header) > HEADER_LEN - HEADER_TAIL:
        raise ValueError("trajectory header too long")
    busy_slot = 0 if busy is None else 1 + round(min(max(busy, 0.0), 1.0) * 1000)
    tail = [busy_slot, 0, 0, int(flags)]
    if canary is not None:
        payload.append(canary.logprobs.detach().float().contiguous().cpu())
        tail = [busy_slot, canary.logprobs.numel(), canary.version + 1, int(flags)]
    return torch.tensor(header + [0] * (HEADER_LEN - HEADER_TAIL - len(header)) + tail, dtype=torch.int64), payload


def send_batch(batch: TrajectoryBatch, dst: int, group, flags: int = 0, canary: ProbeScore | None = None,
               busy: float | None = None) -> None:
    """Blocking send of one shard to global rank `dst`."""
    header, payload = encode_batch(batch, flags, canary, busy)
    for t in (header, *payload):
        dist.send(t, dst=dst, group=group)


def recv_batch(src: int, group) -> Shard:
    """Blocking receive of one shard from global rank `src`."""
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
    busy_slot, probe_len, probe_version, flags = h[-HEADER_TAIL:]
    canary = None
    if probe_version:
        logprobs = torch.empty(probe_len, dtype=torch.float32)
        dist.recv(logprobs, src=src, group=group)
        canary = ProbeScore(probe_version - 1, logprobs)
    return Shard(TrajectoryBatch(**out), RunFlags(flags), canary, (busy_slot - 1) / 1000 if busy_slot else None)


class TrajectorySender:
    """Sends batches from a background thread, so sampling goes on while learners receive.

    Blocking sends in one thread rather than `isend` handles kept by the caller: gloo isend work
    objects created under torch.profiler and freed after it stopped crashed the process.
    `wait_through(k)` blocks until every send of batches <= k is done.
    """

    def __init__(self, group, first_index: int = 0):
        self.group = group
        self._queue: queue.Queue = queue.Queue()
        self._done = first_index - 1  # a resumed run starts past batches it never sends
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="colocate-trajectory-sender", daemon=True)
        self._thread.start()

    def submit(self, index: int, shards: list[tuple[TrajectoryBatch, int]], flags: int = 0,
               canary: ProbeScore | None = None, busy: float | None = None) -> None:
        """Queue batch `index` as (shard, destination rank) pairs; `canary` and `busy` go to every destination."""
        self._queue.put((index, shards, flags, canary, busy))

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
            index, shards, flags, canary, busy = item
            try:
                for batch, dst in shards:
                    send_batch(batch, dst, self.group, flags, canary, busy)
            except BaseException as e:  # a dead peer: surface it in the main thread
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._done = index
                self._cond.notify_all()


# ---------------------------------------------------------------------------------- control

CONTROL_TAG = 7  # control messages never match a trajectory receive, whatever is in flight


def send_json(data: dict, dst: int, group) -> None:
    """Small control payloads (an inference rank's checkpoint state): length, then UTF-8 bytes."""
    raw = torch.frombuffer(bytearray(json.dumps(data).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([raw.numel()], dtype=torch.int64), dst=dst, group=group, tag=CONTROL_TAG)
    dist.send(raw, dst=dst, group=group, tag=CONTROL_TAG)


def recv_json(src: int, group) -> dict:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src=src, group=group, tag=CONTROL_TAG)
    raw = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(raw, src=src, group=group, tag=CONTROL_TAG)
    return json.loads(bytes(raw.tolist()).decode())
