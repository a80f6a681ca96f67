"""The adapter channel into vLLM workers: a stateless NCCL group of learner rank 0 and every engine.

vLLM runs its engine core (and the GPU worker holding the adapter) in a child process of each
inference rank, outside the torchrun world, so a broadcast on the torch sync group cannot reach
it. Instead:

  * learner rank 0 opens a listening socket on a free port and broadcasts the port on the torch
    sync group (`publish_port` / `receive_port`, the only torch.distributed message here);
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

import socket
import time

import torch
import torch.distributed as dist

from colocate.channel import AdapterReceiver, AdapterSender, AdapterUpdate
from colocate.engine.vllm_worker import StatelessGroup, synchronize
from colocate.wire import LoraSpec, RunFlags, adapter_header, flatten_lora

HOST = "127.0.0.1"  # one node: learner rank 0 and the vLLM workers share it


def join_timeout_s(cfg) -> float:
    """How long either end waits for the other to join the group (engine start-up included)."""
    return max(900.0, cfg.topology.timeout_s)


def listen_socket() -> tuple[socket.socket, int]:
    """A listening socket on a free port (the OS picks it: no hard-coded ports, no race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def exchange_port(topo, port: int | None = None) -> int:
    """Learner rank 0 passes its port; every inference rank receives it (one broadcast on the
    torch sync group, which every rank of that group joins)."""
    t = torch.tensor([port or 0], dtype=torch.int64, device=topo.device)
    dist.broadcast(t, src=topo.sync_src, group=topo.sync_group)
    return int(t.item())


class NcclSender(AdapterSender):
    """Learner rank 0's end: the flat adapter (the learner's `LoraGather` buffer) to every engine."""

    def __init__(self, group: StatelessGroup, spec: LoraSpec, *, with_checksum: bool = False):
        self.group, self.spec, self.with_checksum = group, spec, with_checksum
        self.header = torch.empty(4, dtype=torch.int64, device=group.device)

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
        metrics = {"receive_apply_ms": (time.perf_counter() - t0) * 1e3, "apply_ms": got["apply_ms"],
                   "version": got["version"], **({"checksum_ok": 1.0} if got["checksum_ok"] else {})}
        return AdapterUpdate(got["version"], RunFlags(got["flags"]), metrics)


def open_sender(cfg, topo, spec: LoraSpec) -> NcclSender:
    """Learner rank 0 (`train.py`): publish the port, then wait until every engine's worker joined."""
    sock, port = listen_socket()
    exchange_port(topo, port)
    group = StatelessGroup(HOST, port, 0, 1 + topo.num_inference, topo.device, listen=sock,
                           timeout_s=join_timeout_s(cfg))
    return NcclSender(group, spec, with_checksum=cfg.sync.check_checksum)


def receive_port(topo) -> int:
    """Inference ranks, before building the engine (learner rank 0 waits in this broadcast)."""
    return exchange_port(topo)


def join_receiver(cfg, topo, engine, port: int) -> VLLMReceiver:
    """Inference ranks, once the engine is up: its worker joins learner rank 0's group."""
    engine.join_sync(HOST, port, world_size=1 + topo.num_inference, rank=1 + topo.role_rank,
                     timeout_s=join_timeout_s(cfg))
    return VLLMReceiver(engine, verify=cfg.sync.check_checksum)
