"""Adapter sync into vLLM workers: stateless NCCL groups of learner rank 0 and the engines' workers.

With vLLM the engine core (and the GPU worker holding the LoRA buffers) lives in a child process of
each inference rank, outside the torchrun world, so `colocate.sync`'s broadcast on the torch sync
group cannot reach it. Instead (notes/vllm-in-torchrun.md, anchors/colocate_spike.py):

  * learner rank 0 opens one listening socket per group on a free port and broadcasts the port
    numbers on the torch sync group (the only message of this module that uses torch.distributed);
  * every inference rank passes (host, its group's port) to its engine's worker, which joins a vLLM
    `StatelessProcessGroup` + `PyNcclCommunicator` (`group_membership` says which and as what);
  * each update is then `colocate.sync`'s wire format over that communicator: an int64 header
    [version, numel, checksum, flags] and the flat buffer in `LoraSpec` order. The worker applies
    it in place (`vllm_worker.py`) and hands the flags back to the inference rank.

`sync.fanout` picks the groups. broadcast: one group of learner rank 0 + every worker (rank 1 +
inference rank), one broadcast per update, which completes when the last engine joins it, so an
engine that finished its batch early waits there for the others. per_engine: one two-member group
per engine; learner rank 0 sends to each on its own CUDA stream, so each engine takes the version
as soon as it asks for it. Either way the learner's later kernels (the next gather overwrites the
flat buffer) wait until every engine has received it.

Rank 0 of every group is the learner; it serves the rendezvous store. Creating a group blocks until
its workers have joined (engine start-up included), so rank 0 calls `open_sender` before its
training loop and nothing else waits on it meanwhile.
"""
from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

from colocate.engine.vllm_worker import synchronize
from colocate.sync import LoraSpec, flatten_lora

HOST = "127.0.0.1"  # one node: learner rank 0 and the vLLM workers share it
HEADER_NUMEL = 4    # int64 [version, numel, checksum, flags], as colocate.sync
FANOUTS = ("broadcast", "per_engine")


def join_timeout_s(cfg) -> float:
    """How long either end waits for the other to join a group (engine start-up included)."""
    return max(900.0, cfg.topology.timeout_s)


def chunked_checksum(flat: torch.Tensor, chunk_bytes: int = 1 << 26) -> int:
    """`colocate.sync.checksum` computed in chunks: the same integer, bounded temporary memory.

    The reference builds int64 words and weights for the whole buffer (16 bytes per byte of
    adapter); inside a vLLM worker, whose memory is budgeted, that is gigabytes at 7B.
    """
    words = flat.detach().contiguous().view(torch.uint8).view(-1)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), chunk_bytes):
        part = words[start:start + chunk_bytes].to(torch.int64)
        weights = torch.arange(start + 1, start + part.numel() + 1, dtype=torch.int64, device=words.device) % 65521
        total += (part * weights).sum()
    return int(total)


def listen_socket() -> tuple[socket.socket, int]:
    """A listening socket on a free port (the OS picks it: no hard-coded ports, no race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def num_groups(fanout: str, num_engines: int) -> int:
    if fanout not in FANOUTS:
        raise ValueError(f"sync.fanout={fanout!r} is not one of {FANOUTS}")
    return 1 if fanout == "broadcast" else num_engines


def group_membership(fanout: str, num_engines: int, engine: int) -> tuple[int, int, int]:
    """Engine `engine` of `num_engines` -> (group index, group world size, its rank in the group)."""
    if not 0 <= engine < num_engines:
        raise ValueError(f"engine {engine} is not one of {num_engines}")
    if num_groups(fanout, num_engines) == 1:
        return 0, 1 + num_engines, 1 + engine
    return engine, 2, 1


def exchange_ports(topo, ports: list[int] | None = None) -> list[int]:
    """Learner rank 0 sends one port per group on the torch sync group; inference ranks receive
    them (every rank of the sync group takes part; the receivers pass nothing)."""
    t = torch.zeros(topo.num_inference, dtype=torch.int64, device=topo.device)
    if ports is not None:
        t[:len(ports)] = torch.tensor(ports, dtype=torch.int64)
    dist.broadcast(t, src=topo.sync_src, group=topo.sync_group)
    return [int(p) for p in t.tolist()]


class StatelessGroup:
    """A PyNccl communicator over a vLLM `StatelessProcessGroup` (imported lazily: needs vLLM)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device,
                 listen: socket.socket | None = None, timeout_s: float = 900.0):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                          listen_socket=listen, store_timeout=int(timeout_s))
        self.comm = PyNcclCommunicator(pg, device=self.device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0 sends, every other rank receives into `tensor` (on the current stream)."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.comm.broadcast(tensor, src=0, stream=stream)


class AdapterSender:
    """Learner rank 0's end: send the flat adapter (the learner's `LoraGather` buffer) to every group.

    One group (broadcast fan-out) sends on the current stream. Several (per_engine) each send on
    a stream of their own, after the current stream's work (the gather that filled the buffer),
    and the current stream then waits for all of them: an engine that asks first is served first,
    and the buffer is not overwritten before the slowest engine has it."""

    def __init__(self, groups: "StatelessGroup | list[StatelessGroup]", spec: LoraSpec):
        self.groups = list(groups) if isinstance(groups, (list, tuple)) else [groups]
        self.spec = spec
        self.device = self.groups[0].device
        self.headers = [torch.empty(HEADER_NUMEL, dtype=torch.int64, device=self.device) for _ in self.groups]
        self.streams = [torch.cuda.Stream(self.device) for _ in self.groups] \
            if len(self.groups) > 1 and self.device.type == "cuda" else None

    def send(self, flat: torch.Tensor, version: int, *, with_checksum: bool = False, flags: int = 0,
             wait: bool = True) -> float:
        """Send `flat` ([numel] in spec order) as `version` to every engine; seconds spent.
        `wait=False` returns once enqueued (the receivers complete it), which lets one process
        drive both ends in benchmarks. Later kernels on the current stream wait for the sends."""
        t0 = time.perf_counter()
        flat = flatten_lora(flat, self.spec)  # checks shape and dtype, no copy
        sent_sum = chunked_checksum(flat) if with_checksum else 0
        values = torch.tensor([version, self.spec.numel, sent_sum, flags], dtype=torch.int64)
        current = torch.cuda.current_stream(self.device) if self.streams else None
        for group, header, stream in zip(self.groups, self.headers, self.streams or [None] * len(self.groups)):
            if stream is not None:
                stream.wait_stream(current)  # the buffer is complete before any engine gets it
            with torch.cuda.stream(stream):  # None: the current stream
                header.copy_(values)
                group.broadcast(header)
                group.broadcast(flat)
        for stream in self.streams or []:
            current.wait_stream(stream)
        if wait:
            self.wait_sent()
        return time.perf_counter() - t0

    def wait_sent(self) -> float:
        """Block until every engine has received the last version; seconds spent. Until then the
        learner's next kernels would queue behind the sends, and its step would seem to train
        while it waits for an engine that asks for the version late (`config.sampling_lag` > 1)."""
        t0 = time.perf_counter()
        synchronize(self.device)  # the current stream already waits for the side streams
        return time.perf_counter() - t0


def open_sender(topo, spec: LoraSpec, fanout: str = "broadcast", timeout_s: float = 900.0) -> AdapterSender:
    """Learner rank 0 (train.py): publish the ports, then wait for every inference rank's worker
    (groups in engine order; each engine joins only its own)."""
    n = num_groups(fanout, topo.num_inference)
    sockets = [listen_socket() for _ in range(n)]
    ports = [port for _, port in sockets]
    exchange_ports(topo, ports * topo.num_inference if n == 1 else ports)
    world = group_membership(fanout, topo.num_inference, 0)[1]
    groups = [StatelessGroup(HOST, port, 0, world, topo.device, listen=sock, timeout_s=timeout_s)
              for sock, port in sockets]
    return AdapterSender(groups, spec)
