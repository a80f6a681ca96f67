"""Adapter sync into vLLM workers: one stateless NCCL group of learner rank 0 + one worker per engine.

With vLLM the engine core (and the GPU worker holding the LoRA buffers) lives in a child process of
each inference rank, outside the torchrun world, so `colocate.sync`'s broadcast on the torch sync
group cannot reach it. Instead (notes/vllm-in-torchrun.md, anchors/colocate_spike.py):

  * learner rank 0 opens a listening socket on a free port and broadcasts the port number on the
    torch sync group (the only message of this module that uses torch.distributed);
  * every inference rank passes (host, port) to its engine's worker, which joins a vLLM
    `StatelessProcessGroup` + `PyNcclCommunicator` as rank 1 + inference rank;
  * each update is then `colocate.sync`'s wire format over that communicator: an int64 header
    [version, numel, checksum, flags] and the flat buffer in `LoraSpec` order. The worker applies
    it in place (`vllm_worker.py`) and hands the flags back to the inference rank.

Rank 0 of the group is the learner; it serves the rendezvous store. Creating the group blocks until
every worker has joined (engine start-up included), so rank 0 calls `open_sender` before its
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


def exchange_port(topo, port: int = 0) -> int:
    """Learner rank 0 sends `port` on the torch sync group; inference ranks receive it."""
    t = torch.tensor([port], dtype=torch.int64, device=topo.device)
    dist.broadcast(t, src=topo.sync_src, group=topo.sync_group)
    return int(t.item())


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
    """Learner rank 0's end: broadcast the flat adapter (the learner's `LoraGather` buffer)."""

    def __init__(self, group: StatelessGroup, spec: LoraSpec):
        self.group = group
        self.spec = spec
        self.header = torch.empty(HEADER_NUMEL, dtype=torch.int64, device=group.device)

    def send(self, flat: torch.Tensor, version: int, *, with_checksum: bool = False, flags: int = 0,
             wait: bool = True) -> float:
        """Broadcast `flat` ([numel] in spec order) as `version`; seconds spent. `wait=False` returns
        once enqueued (the receivers complete it), which lets one process drive both ends in
        benchmarks. The buffer must not change before the broadcast ran: the learner's next gather
        is later on the same stream."""
        t0 = time.perf_counter()
        flat = flatten_lora(flat, self.spec)  # checks shape and dtype, no copy
        sent_sum = chunked_checksum(flat) if with_checksum else 0
        self.header.copy_(torch.tensor([version, self.spec.numel, sent_sum, flags], dtype=torch.int64))
        self.group.broadcast(self.header)
        self.group.broadcast(flat)
        if wait:
            synchronize(self.group.device)
        return time.perf_counter() - t0


def open_sender(topo, spec: LoraSpec, timeout_s: float = 900.0) -> AdapterSender:
    """Learner rank 0 (train.py): publish a port, then wait for every inference rank's worker."""
    sock, port = listen_socket()
    exchange_port(topo, port)
    group = StatelessGroup(HOST, port, 0, 1 + topo.num_inference, topo.device, listen=sock, timeout_s=timeout_s)
    return AdapterSender(group, spec)
