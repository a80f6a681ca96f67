"""The adapter channel into vLLM workers: a stateless NCCL group of learner rank 0 and every engine.

vLLM runs its engine core (and the GPU worker holding the adapter) in a child process of each
inference rank, outside the torchrun world, so a broadcast on the torch sync group cannot reach
it. Instead:

  * learner rank 0 opens a listening socket on a free port of its node's address and broadcasts
    the address and port on the torch sync group (`exchange_endpoint`, the only torch.distributed
    message here). The address is 127.0.0.1 when the whole job runs on one node, else the address
    of learner rank 0's node as the other nodes reach it (`node_address`);
  * each inference rank builds its engine, then has the engine's worker join a vLLM
    `StatelessProcessGroup` + `PyNcclCommunicator` as rank 1 + its inference index;
  * each update is `colocate.wire`'s adapter format over that communicator: the int64 header and
    the flat buffer in `LoraSpec` order. The worker applies it in place (`vllm_worker.py`) and
    hands the header's flags back to the inference rank.

One broadcast per update completes when the last engine joins it, so an engine that finished its
batch early waits there for the others. The learner's later kernels (the next gather overwrites the
flat buffer) wait until every engine has received it. Rank 0 of the group is the learner; it
serves the rendezvous store. Creating the group blocks until every worker has joined (engine
start-up included), so learner rank 0 opens it before its training loop.
"""
from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from colocate.channel import AdapterReceiver, AdapterSender, AdapterUpdate, receive_ipc_ring
from colocate.engine.vllm_worker import AdapterReceipt, StatelessGroup, synchronize
from colocate.wire import ADAPTER_HEADER_NUMEL, LoraSpec, RunFlags, adapter_header, flatten_lora

LOCAL_HOST = "127.0.0.1"
ADDRESS_BYTES = 64


def node_address(environ=os.environ) -> str:
    """The address other nodes reach this one at: 127.0.0.1 when every rank of the job is on this
    node, else the source address of this node's route to the rendezvous host (MASTER_ADDR), which
    is the interface the job's own traffic already uses."""
    if int(environ.get("LOCAL_WORLD_SIZE", "1")) >= int(environ.get("WORLD_SIZE", "1")):
        return LOCAL_HOST
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
        probe.connect((environ.get("MASTER_ADDR", LOCAL_HOST), int(environ.get("MASTER_PORT", "29500"))))
        return probe.getsockname()[0]


def join_timeout_s(cfg) -> float:
    """How long either end waits for the other to join the group (engine start-up included)."""
    return max(900.0, cfg.topology.timeout_s)


def listen_socket(host: str) -> tuple[socket.socket, int]:
    """A listening socket on a free port of `host` (the OS picks it: no hard-coded ports, no race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def exchange_endpoint(topo, endpoint: tuple[str, int] | None = None) -> tuple[str, int]:
    """Learner rank 0 passes its (address, port); every inference rank receives it: one broadcast
    of [port, address bytes...] on the torch sync group, which every rank of that group joins."""
    t = torch.zeros(1 + ADDRESS_BYTES, dtype=torch.int64)
    if endpoint is not None:
        host, port = endpoint
        raw = host.encode()
        if len(raw) > ADDRESS_BYTES:
            raise ValueError(f"sync address {host!r} is longer than {ADDRESS_BYTES} bytes")
        t[0] = port
        t[1:1 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    t = t.to(topo.device)
    dist.broadcast(t, src=topo.sync_src, group=topo.sync_group)
    values = t.tolist()
    return bytes(v for v in values[1:] if v).decode(), int(values[0])


class NcclSender(AdapterSender):
    """Learner rank 0's end: the flat adapter (the learner's `LoraGather` buffer) to every engine."""

    def __init__(self, group: StatelessGroup, spec: LoraSpec, *, with_checksum: bool = False):
        self.group, self.spec, self.with_checksum = group, spec, with_checksum
        self.header = torch.empty(ADAPTER_HEADER_NUMEL, dtype=torch.int64, device=group.device)

    def send(self, flat: torch.Tensor, version: int, flags: RunFlags = RunFlags.NONE, *, wait: bool = False) -> float:
        """Enqueue the update on the current stream and return, like `dist.broadcast`: later
        kernels wait for it, and `wait_sent` blocks until every engine has it. `wait=True` blocks
        here (benchmarks that time the send alone)."""
        t0 = time.perf_counter()
        flat = flatten_lora(flat, self.spec)  # checks the layout, no copy
        self.header.copy_(adapter_header(version, self.spec, flat if self.with_checksum else None, flags))
        self.group.broadcast(self.header)
        self.group.broadcast(flat)
        if wait:
            self.wait_sent()
        return time.perf_counter() - t0

    def wait_sent(self) -> float:
        """Block until every engine has received the last version; seconds spent. Until then the
        learner's next kernels would queue behind the send, and its step would seem to train while
        it waits for an engine that asks for the version late (`config.sampling_lag` > 1)."""
        t0 = time.perf_counter()
        synchronize(self.group.device)
        return time.perf_counter() - t0


class VLLMReceiver(AdapterReceiver):
    """An inference rank's end: its engine's worker takes the broadcast and applies it in place."""

    def __init__(self, engine, *, verify: bool = False):
        self.engine, self.verify = engine, verify

    def receive(self) -> AdapterUpdate:
        t0 = time.perf_counter()
        got = self.engine.receive_lora(verify=self.verify)  # raises on a checksum or slot mismatch
        return self.update(got, t0)

    @staticmethod
    def update(got: AdapterReceipt, t0: float) -> AdapterUpdate:
        metrics = {"receive_apply_ms": (time.perf_counter() - t0) * 1e3, "apply_ms": got.apply_ms,
                   "version": got.version, **({"checksum_ok": 1.0} if got.checksum_ok else {})}
        return AdapterUpdate(got.version, RunFlags(got.flags), metrics)


def open_sender(cfg, topo, spec: LoraSpec, before_join=lambda: None) -> NcclSender:
    """Learner rank 0 (`train.py`): publish the port, run `before_join` (the learner's warm-up, while
    the engines start), then wait until every engine's worker joined."""
    host = node_address()
    sock, port = listen_socket(host)
    exchange_endpoint(topo, (host, port))
    before_join()
    group = StatelessGroup(host, port, 0, 1 + topo.num_inference, topo.device, listen=sock,
                           timeout_s=join_timeout_s(cfg))
    return NcclSender(group, spec, with_checksum=cfg.sync.check_checksum)


def receive_endpoint(topo) -> tuple[str, int]:
    """Inference ranks, before building the engine (learner rank 0 waits in this broadcast)."""
    return exchange_endpoint(topo)


def join_receiver(cfg, topo, engine, endpoint: tuple[str, int]) -> VLLMReceiver:
    """Inference ranks, once the engine is up: its worker joins learner rank 0's group."""
    host, port = endpoint
    engine.join_sync(host, port, world_size=1 + topo.num_inference, rank=1 + topo.role_rank,
                     timeout_s=join_timeout_s(cfg))
    return VLLMReceiver(engine, verify=cfg.sync.check_checksum)


class VLLMIpcReceiver(AdapterReceiver):
    """Roles on one GPU (`channel.IpcSender`): the header over the gloo sync group, then the
    engine's worker copies the version's slot of the shared ring into its adapter."""

    def __init__(self, engine, topo, *, verify: bool = False):
        self.engine, self.topo, self.verify = engine, topo, verify
        engine.attach_ipc(receive_ipc_ring(src=topo.sync_src, group=topo.sync_group, rank=topo.rank))
        self.header = torch.zeros(ADAPTER_HEADER_NUMEL, dtype=torch.int64)

    def receive(self) -> AdapterUpdate:
        t0 = time.perf_counter()
        dist.broadcast(self.header, src=self.topo.sync_src, group=self.topo.sync_group)
        got = self.engine.receive_lora(verify=self.verify, header=self.header.tolist())
        return VLLMReceiver.update(got, t0)

    def close(self) -> None:
        dist.barrier(group=self.topo.sync_group)  # the learner (the ring's owner) may exit now
