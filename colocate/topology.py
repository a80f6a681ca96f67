"""Topology: the torchrun world split into inference and learner ranks, built once, passed explicitly.

Which global ranks take which role is the placement (`place_roles`): on one node the first
num_inference ranks infer and the rest learn; over several nodes `topology.placement` decides
whether inference ranks fill the first nodes (`by_node`) or every node holds both roles
(`interleaved`). Process groups:
  * learner_group   - all learner ranks (gradient reduction / FSDP2 mesh);
  * sync_group      - learner rank 0 (the adapter source) + every inference rank;
  * transport_group - every rank, always gloo (inference -> learner trajectories, host tensors).
Nothing after start-up runs collectives on the default group. gloo on CPU, NCCL on GPU, except
that a group whose members share a GPU is gloo (NCCL refuses it; `group_backend`): with 2 processes
on one GPU the learner group stays NCCL and the sync group carries only the IPC channel's header.
Every group gets the configured timeout, so a dead peer ends the job instead of hanging it.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colocate.config import Config
from colocate.config_checks import resolve_roles


def split_cpu_threads(local_world: int) -> int:
    """Set and return torch's intra-op threads for one of `local_world` ranks on this host: the cores
    this process may run on (its affinity: what SLURM or a container grants) split evenly. Left at its default every rank takes all cores; 4 learner processes on a 64-core
    host then ran the packing's small CPU ops at 37-48 ms each, 12 % of a 7B step (profiles/trainer.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, local_world))
    torch.set_num_threads(threads)
    return threads


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    num_inference: int
    num_learners: int
    device: torch.device
    backend: str
    learner_group: object = field(default=None, repr=False)
    sync_group: object = field(default=None, repr=False)
    transport_group: object = field(default=None, repr=False)
    roles: tuple[str, ...] = ()
    """The role of every global rank; () means the first num_inference ranks infer."""
    shared_gpu: bool = False
    """The inference ranks run on learner rank 0's GPU: the adapter goes by CUDA IPC, and the sync
    group is gloo (`check_shared_gpus`)."""

    def __post_init__(self):
        if not self.roles:
            self.roles = ("inference",) * self.num_inference + ("learner",) * (self.world_size - self.num_inference)

    @property
    def role(self) -> str:
        return self.roles[self.rank]

    @property
    def inference_ranks(self) -> list[int]:
        return [r for r, role in enumerate(self.roles) if role == "inference"]

    @property
    def learner_ranks(self) -> list[int]:
        return [r for r, role in enumerate(self.roles) if role == "learner"]

    @property
    def role_rank(self) -> int:
        """Index within the role (0 = the role's logging rank)."""
        return (self.inference_ranks if self.role == "inference" else self.learner_ranks).index(self.rank)

    def share(self, total: int) -> int:
        """This inference rank's part of `total` (groups per step) split as evenly as possible: the
        first `total % num_inference` ranks take one more (32 groups on 6 ranks: 6, 6, 5, 5, 5, 5)."""
        if self.role != "inference":
            raise ValueError(f"rank {self.rank} is a {self.role} rank: only inference ranks take a share of groups")
        base, extra = divmod(total, self.num_inference)
        return base + (self.role_rank < extra)

    @property
    def sync_src(self) -> int:
        """Global rank that broadcasts adapters: learner rank 0."""
        return self.learner_ranks[0]


PLACEMENTS = ("interleaved", "by_node")


def place_roles(cfg: Config, world: int, local_world: int) -> list[str]:
    """The role of every global rank (torchrun numbers ranks node by node).

    One node: the first num_inference ranks infer. Several nodes (`world // local_world`):
      * by_node: inference ranks fill the first nodes and learners the rest, so the learners'
        FSDP traffic stays inside nodes; num_inference must fill whole nodes;
      * interleaved: every node holds both roles in the same proportion (its first local ranks
        infer); both counts must divide by the number of nodes.
    A layout that cannot work raises ValueError (one line naming the keys)."""
    num_inference, num_learners = resolve_roles(cfg, world)
    placement = cfg.topology.placement
    if local_world < 1 or world % local_world:
        raise ValueError(f"topology: world size {world} is not a whole number of nodes of {local_world} processes")
    nodes = world // local_world
    if nodes == 1:
        return ["inference"] * num_inference + ["learner"] * num_learners
    if placement == "by_node":
        if num_inference % local_world:
            raise ValueError(f"topology.placement=by_node: {num_inference} inference ranks do not fill whole nodes "
                             f"of {local_world} processes; set topology.num_inference to a multiple of {local_world} "
                             "or use topology.placement=interleaved")
        return ["inference"] * num_inference + ["learner"] * num_learners
    if num_inference % nodes or num_learners % nodes:
        raise ValueError(f"topology.placement=interleaved: {num_inference} inference and {num_learners} learner ranks "
                         f"do not split evenly over {nodes} nodes; use topology.placement=by_node or other counts")
    per_node = ["inference"] * (num_inference // nodes) + ["learner"] * (num_learners // nodes)
    return per_node * nodes


def resolve_backend(cfg: Config) -> str:
    if cfg.sync.backend != "auto":
        return cfg.sync.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def rank_devices(world: int, local_world: int, gpus: int) -> list[tuple[int, int]]:
    """(node, GPU index) of every global rank: torchrun numbers ranks node by node, and a node with
    more processes than GPUs shares them round-robin (local rank % GPUs)."""
    return [(r // local_world, (r % local_world) % max(1, gpus)) for r in range(world)]


def group_backend(members: list[int], devices: list[tuple[int, int]], backend: str) -> str:
    """NCCL only for a group whose members sit on distinct GPUs: NCCL refuses two ranks of one
    communicator on one device. Groups of ranks that share a GPU use gloo."""
    on = [devices[r] for r in members]
    return backend if backend != "nccl" or len(set(on)) == len(on) else "gloo"


def check_shared_gpus(roles: list[str], devices: list[tuple[int, int]]) -> None:
    """Ranks may share a GPU only where the adapter channel can handle it: every inference rank on
    learner rank 0's GPU (CUDA IPC), or none of them (NCCL). ValueError otherwise (one line)."""
    learners = [r for r, role in enumerate(roles) if role == "learner"]
    inference = [r for r, role in enumerate(roles) if role == "inference"]
    on_source = [devices[r] == devices[learners[0]] for r in inference]
    if any(on_source) and not all(on_source):
        raise ValueError(f"topology: inference ranks {[r for r, s in zip(inference, on_source) if s]} share learner "
                         f"rank 0's GPU but {[r for r, s in zip(inference, on_source) if not s]} do not; the adapter "
                         f"travels by CUDA IPC to all or by NCCL to all: give every rank its own GPU, or run all "
                         f"{len(roles)} on one (CUDA_VISIBLE_DEVICES=0)")


def build_topology(cfg: Config) -> Topology:
    """Init the default group from the torchrun environment and build the role groups."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    num_inference, num_learners = resolve_roles(cfg, world)
    roles = tuple(place_roles(cfg, world, local_world))
    backend = resolve_backend(cfg)
    devices = rank_devices(world, local_world, torch.cuda.device_count() if backend == "nccl" else 1)
    if backend == "nccl":
        device = torch.device("cuda", devices[rank][1])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=cfg.topology.timeout_s)
    everyone = list(range(world))
    default = group_backend(everyone, devices, backend)
    if not dist.is_initialized():
        dist.init_process_group(backend=default, timeout=timeout, device_id=device if default == "nccl" else None)
    learners = [r for r, role in enumerate(roles) if role == "learner"]
    inference = [r for r, role in enumerate(roles) if role == "inference"]
    sync_members = sorted([learners[0]] + inference)
    # Every rank creates every group, in the same order (a torch.distributed requirement).
    learner_group = dist.new_group(learners, timeout=timeout, backend=group_backend(learners, devices, backend))
    sync_group = dist.new_group(sync_members, timeout=timeout, backend=group_backend(sync_members, devices, backend))
    # Trajectories are small host tensors (ids, log-probs): gloo moves them without touching GPUs.
    transport_group = dist.new_group(everyone, timeout=timeout, backend="gloo")
    return Topology(rank=rank, world_size=world, local_rank=local_rank, num_inference=num_inference,
                    num_learners=num_learners, device=device, backend=backend, learner_group=learner_group,
                    sync_group=sync_group, transport_group=transport_group, roles=roles,
                    shared_gpu=backend == "nccl" and devices[inference[0]] == devices[learners[0]])


def gpu_index(topo: Topology) -> int | None:
    """This rank's CUDA device index (for NVML), None on CPU."""
    return topo.device.index if topo.device.type == "cuda" else None
