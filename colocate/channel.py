"""The adapter channel: how each new adapter version goes from the learners to the inference ranks.

One interface with two sides, so the role loops never ask which engine is on the other end:
  * `AdapterSender`, on every learner rank: `send(flat, version, flags)` once per step, after the
    adapter gather every learner joins. Only the sync source (learner rank 0) puts bytes on the
    wire; the other learners hold a `NoSender`.
  * `AdapterReceiver`, on every inference rank: `receive()` takes the next version into the
    engine and returns it with the run-control flags of its header.

Implementations, chosen by the composition root (`train.py`) from the engine kind:
  * `BroadcastSender` / `BroadcastReceiver` (here): two torch.distributed broadcasts on the sync
    group (header, then the flat buffer; `colocate.wire`), then `engine.load_lora`. For engines
    that live in the inference rank's own process: the HF reference engine (gloo on CPU).
  * `IpcSender` / `IpcReceiver` (here), for roles that share one GPU (NCCL refuses two ranks of
    one communicator on one device): learner rank 0 shares one flat CUDA buffer with every engine
    once (CUDA IPC, `wire.share_cuda_buffer`), a ring of slots; an update is a device copy into the
    version's slot, then the header on the gloo sync group, and the engine copies the slot into its
    adapter. No bytes leave the GPU.
  * `engine/vllm_channel.py`: vLLM runs its engine core in a child process outside the torchrun
    world, so learner rank 0 broadcasts on a stateless NCCL group the vLLM workers joined, and the
    worker applies the update in place.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from colocate.wire import (ADAPTER_HEADER_NUMEL, LoraSpec, RunFlags, adapter_header, broadcast_json, checksum,
                           flatten_lora, open_cuda_buffer, parse_adapter_header, share_cuda_buffer, unflatten_lora)


@dataclass(frozen=True)
class AdapterUpdate:
    version: int
    flags: RunFlags
    metrics: dict[str, float]
    """TensorBoard `sync/...` scalars of this update (times in ms, checksum_ok when verified)."""


class AdapterSender:
    """Learner side. `send` returns the seconds it spent; `wait_sent` blocks until every inference
    rank holds the last version (seconds spent)."""

    def send(self, flat: torch.Tensor, version: int, flags: RunFlags) -> float:
        raise NotImplementedError

    def wait_sent(self) -> float:
        return 0.0

    def ready(self) -> None:
        """Wait until the engines can take updates (a handshake still running: `IpcSender`); what
        failed in it is raised here, before the first step."""

    def close(self) -> float:
        """End of the run: every engine holds the last version (seconds spent)."""
        return self.wait_sent()


class AdapterReceiver:
    """Inference side: take the next version into the engine."""

    def receive(self) -> AdapterUpdate:
        raise NotImplementedError

    def close(self) -> None:
        """End of the run, after the last `receive` (the IPC channel's closing barrier)."""


class NoSender(AdapterSender):
    """Learner ranks other than the sync source: they join the gather, the source sends."""

    def send(self, flat: torch.Tensor, version: int, flags: RunFlags) -> float:
        return 0.0


class BroadcastSender(AdapterSender):
    """Learner rank 0: header + flat buffer as two broadcasts on the torch sync group."""

    def __init__(self, spec: LoraSpec, *, src: int, group, with_checksum: bool = False):
        self.spec, self.src, self.group, self.with_checksum = spec, src, group, with_checksum

    def send(self, flat: torch.Tensor, version: int, flags: RunFlags) -> float:
        t0 = time.perf_counter()
        flat = flatten_lora(flat, self.spec)  # checks the layout, no copy
        header = adapter_header(version, self.spec, flat if self.with_checksum else None, flags)
        dist.broadcast(header.to(flat.device), src=self.src, group=self.group)
        dist.broadcast(flat, src=self.src, group=self.group)
        return time.perf_counter() - t0


class BroadcastReceiver(AdapterReceiver):
    """Inference rank with an in-process engine: receive both broadcasts, then `engine.load_lora`.
    With a checksum in the header it proves the engine then samples with the learner's bytes."""

    def __init__(self, engine, spec: LoraSpec, *, src: int, group, device):
        self.engine, self.spec, self.src, self.group = engine, spec, src, group
        self.header = torch.zeros(ADAPTER_HEADER_NUMEL, dtype=torch.int64, device=device)
        self.flat = torch.empty(spec.numel, dtype=spec.dtype, device=device)

    def receive(self) -> AdapterUpdate:
        t0 = time.perf_counter()
        dist.broadcast(self.header, src=self.src, group=self.group)
        head = parse_adapter_header(self.header, self.spec)
        dist.broadcast(self.flat, src=self.src, group=self.group)
        if head.checksum and checksum(self.flat) != head.checksum:
            raise RuntimeError(f"adapter version {head.version} arrived corrupted (checksum mismatch)")
        t1 = time.perf_counter()
        self.engine.load_lora(head.version, unflatten_lora(self.flat, self.spec))
        metrics = {"receive_ms": (t1 - t0) * 1e3, "apply_ms": (time.perf_counter() - t1) * 1e3,
                   "version": head.version}
        if head.checksum:
            live = checksum(flatten_lora(self.engine.lora_state(), self.spec))
            if live != head.checksum:
                raise RuntimeError(f"adapter version {head.version}: the engine's adapter differs from the learner's")
            metrics["checksum_ok"] = 1.0
        return AdapterUpdate(head.version, head.flags, metrics)


class IpcSender(AdapterSender):
    """Learner rank 0 on a GPU it shares with the engines: the update is a copy into a ring of
    `slots` buffers the engines mapped at start-up (version v in slot v % slots), then the [4]
    header on the gloo sync group.

    No acknowledgement is needed mid-run: an engine takes every version in order, and takes version
    v before it plays batch v + sampling lag, which the learner trains before it sends version
    v + sampling lag + 1. So with slots = max_policy_lag + 1 the learner never overwrites a slot an
    engine has yet to read. At the end both sides meet in one barrier (`close`), so the learner's
    process, which owns the memory, outlives the engines' last copy."""

    def __init__(self, spec: LoraSpec, *, src: int, group, device, slots: int, with_checksum: bool = False,
                 background: bool = False):
        """`background`: the handshake (the ring's description to the engines, then the barrier that
        says they have started) runs on a thread, so the caller can warm up meanwhile; the first
        `send` waits for it."""
        self.spec, self.src, self.group, self.with_checksum = spec, src, group, with_checksum
        self.ring = torch.zeros(slots, spec.numel, dtype=spec.dtype, device=device)
        description = share_cuda_buffer(self.ring)
        self._failure: BaseException | None = None
        self._handshake = threading.Thread(target=self._shake, args=(description,), name="ipc-handshake", daemon=True)
        self._handshake.start()
        if not background:
            self.ready()

    def _shake(self, description: dict) -> None:
        try:
            broadcast_json(description, src=self.src, group=self.group, rank=self.src)
            dist.barrier(group=self.group)  # returns once every engine has the ring's description (and so has started)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread (`ready`)
            self._failure = e

    def ready(self) -> None:
        """Wait for the handshake; what failed in it is raised here."""
        self._handshake.join()
        if self._failure is not None:
            raise self._failure

    def send(self, flat: torch.Tensor, version: int, flags: RunFlags) -> float:
        self.ready()
        t0 = time.perf_counter()
        slot = self.ring[version % len(self.ring)]
        slot.copy_(flatten_lora(flat, self.spec))
        torch.cuda.current_stream(slot.device).synchronize()  # the bytes are there before the header
        header = adapter_header(version, self.spec, slot if self.with_checksum else None, flags)
        dist.broadcast(header, src=self.src, group=self.group)
        return time.perf_counter() - t0

    def close(self) -> float:
        self.ready()
        t0 = time.perf_counter()
        dist.barrier(group=self.group)
        return time.perf_counter() - t0


def receive_ipc_ring(*, src: int, group, rank: int) -> dict:
    """Inference ranks, once their engine is up: learner rank 0's ring description
    (`IpcSender.__init__`), then the barrier that tells learner rank 0 the engines have started."""
    ring = broadcast_json(None, src=src, group=group, rank=rank)
    dist.barrier(group=group)
    return ring


class IpcReceiver(AdapterReceiver):
    """An inference rank whose in-process engine (HF) shares learner rank 0's GPU: the header, then
    `load_lora` copies the version's slot of the shared ring into the engine."""

    def __init__(self, engine, spec: LoraSpec, *, src: int, group, rank: int, device):
        self.engine, self.spec, self.src, self.group = engine, spec, src, group
        self.ring = open_cuda_buffer(receive_ipc_ring(src=src, group=group, rank=rank), device)
        self.header = torch.zeros(ADAPTER_HEADER_NUMEL, dtype=torch.int64)

    def receive(self) -> AdapterUpdate:
        t0 = time.perf_counter()
        dist.broadcast(self.header, src=self.src, group=self.group)
        head = parse_adapter_header(self.header, self.spec)
        t1 = time.perf_counter()
        self.engine.load_lora(head.version, unflatten_lora(self.ring[head.version % len(self.ring)], self.spec))
        torch.cuda.current_stream(self.ring.device).synchronize()
        metrics = {"receive_ms": (t1 - t0) * 1e3, "apply_ms": (time.perf_counter() - t1) * 1e3,
                   "version": head.version}
        if head.checksum:
            if checksum(flatten_lora(self.engine.lora_state(), self.spec)) != head.checksum:
                raise RuntimeError(f"adapter version {head.version}: the engine's adapter differs from the learner's")
            metrics["checksum_ok"] = 1.0
        return AdapterUpdate(head.version, head.flags, metrics)

    def close(self) -> None:
        dist.barrier(group=self.group)
