"""vLLM worker extension: the adapter lives in one pinned LoRA slot (or is merged into the base
weights) and is overwritten in place.

Loaded by vLLM inside its GPU worker (`LLM(worker_extension_cls=...)`); the methods below become
worker methods that `VLLMEngine` calls with `llm.collective_rpc`. vLLM has no public "LoRA from
tensors" API (it loads adapters from a directory), so instead of going through its loader:

  1. at start-up one zero adapter is registered under a fixed id (`add_dummy_lora`) and pinned, so
     vLLM keeps it in GPU slot `slot` forever and never looks for it on disk; every request names
     that id;
  2. each update lands in a receive buffer (NCCL broadcast from learner rank 0, CUDA IPC, or bytes
     through the RPC) and its target writes it where the engine reads it: the slot's rows, or the
     base weights it is merged into (`adapter_targets.py`: what each target writes, and how).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass

import torch

from colocate.engine.adapter_targets import (AdapterSlot, MergedFp8Adapter, merge_plan, merged_target, slot_plan,
                                             slot_views)
from colocate.engine.vllm_settings import MERGED_HEADROOM_BYTES
from colocate.wire import ADAPTER_HEADER_NUMEL, LoraSpec, checksum, open_cuda_buffer, parse_adapter_header

SLOT_ID = 1
"""The one adapter id every request uses (vLLM ids start at 1)."""
IN_MEMORY_PATH = "/colocate/in-memory-adapter"
"""LoRARequest needs a path; this one is never read because the id is registered and pinned."""

@dataclass(frozen=True)
class AdapterReceipt:
    """What a worker reports after applying one update; crosses vLLM's RPC as a dict of plain values
    (`to_rpc`, `from_rpc`)."""
    version: int
    checksum: int               # the checksum the header carried (0: none sent)
    checksum_ok: bool | None    # the received bytes against it (None: none sent)
    slot_ok: bool | None        # the slot (or merged weights) against the bytes (None: not verified)
    flags: int                  # the header's `RunFlags`
    apply_ms: float             # the worker's time to apply the update

    def to_rpc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_rpc(cls, got: dict) -> AdapterReceipt:
        return cls(**got)


@contextlib.contextmanager
def start_up_compiles():
    """Our kernels' warm-ups compile them at engine start on purpose, after vLLM's own warm-up has
    switched on its JIT monitor, which takes every later Triton compile for one inside inference: it
    logs "JIT compilation during inference ... latency spike" (in its error mode it raises). Its hook
    (Triton's `jit_post_compile_hook`) is held off for these compiles and put back after."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        hook = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):  # no Triton, or one without the hook: nothing is reported
        yield
        return
    runtime.jit_post_compile_hook = None
    try:
        yield
    finally:
        runtime.jit_post_compile_hook = hook


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class StatelessGroup:
    """A PyNccl communicator over a vLLM `StatelessProcessGroup` (imported lazily: needs vLLM).
    Learner rank 0 is rank 0 (and serves the rendezvous store); each engine's worker joins it."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device,
                 listen=None, timeout_s: float = 900.0):
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


class ColocateWorkerExtension:
    """Methods injected into vLLM's GPU worker (`self` is the worker: `model_runner`, `device`)."""

    def colocate_init_adapter(self, names: list[str], shapes: list[list[int]], dtype: str, rank: int,
                              scaling: float) -> dict:
        from vllm.lora.request import LoRARequest
        manager = self.model_runner.lora_manager
        manager.add_dummy_lora(LoRARequest("colocate", SLOT_ID, IN_MEMORY_PATH), rank=rank)
        manager.pin_adapter(SLOT_ID)  # registered + active in a GPU slot, never evicted
        adapters = manager._adapter_manager
        slot = adapters.lora_index_to_id.index(SLOT_ID)
        spec = LoraSpec(tuple(names), tuple(tuple(s) for s in shapes), getattr(torch, dtype))
        plan = slot_plan(spec.names, set(adapters.modules), adapters.packed_modules)
        shape_of = dict(zip(spec.names, spec.shapes))
        dst = [slot_views(adapters.modules[t.module], t.slice_index, slot, t.is_a, shape_of[t.name]) for t in plan]
        self.colocate_slot = AdapterSlot(spec, dst, [t.is_a for t in plan], scaling)
        self.colocate_group = None
        return {"slot": slot, "numel": spec.numel, "lora_dtype": str(dst[0].dtype),
                "modules": len({t.module for t in plan})}

    def colocate_init_merged(self, names: list[str], shapes: list[list[int]], dtype: str, scaling: float,
                             quantization: str = "none") -> dict:
        """Merged mode: keep W0 of every adapted weight (e4m3 with engine.quantization fp8); updates
        are merged into the live weights."""
        model = self.model_runner.get_model()  # unwrapped from vLLM's CUDA-graph wrapper
        linear = {n: m for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
                  and m.weight.dim() == 2}
        packed = {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()}
        spec = LoraSpec(tuple(names), tuple(tuple(s) for s in shapes), getattr(torch, dtype))
        plan = merge_plan(spec.names, spec.shapes, set(linear), packed)
        need, build = merged_target(spec, plan, linear, scaling, quantization)

        def too_little(free: int) -> RuntimeError:
            return RuntimeError(f"engine.lora_mode=merged keeps a copy of the adapted base weights ({need / 2**30:.1f} "
                                f"GiB) but only {free / 2**30:.1f} GiB are free on {self.device} (other processes on "
                                "it included): lower engine.gpu_memory_utilization")
        free, _ = torch.cuda.mem_get_info(self.device)
        if need + MERGED_HEADROOM_BYTES > free:
            raise too_little(free)
        try:
            self.colocate_slot = build()
        except torch.cuda.OutOfMemoryError:  # another process took the room between the check and now
            raise too_little(torch.cuda.mem_get_info(self.device)[0]) from None
        self.colocate_group = None
        return {"slot": None, "numel": spec.numel, "lora_dtype": str(self.colocate_slot.staged.dtype),
                "modules": len({t.module for t in plan}), "base_copy_gib": need / 2**30,
                "fp8": isinstance(self.colocate_slot, MergedFp8Adapter)}

    def colocate_use_logprob_kernel(self) -> str:
        """Our sampled-token log-prob kernel in this worker's sampler (`vllm_logprobs.py`), compiled now."""
        from colocate.engine.vllm_logprobs import install, warm_up
        used = install(type(self.model_runner).__module__)
        if used == "ours":
            with start_up_compiles():
                warm_up(self.model_runner.model_config.get_vocab_size(), self.model_runner.device)
        return used

    def colocate_logprob_calls(self) -> dict:
        """{"ours": n, "vllm": m}: the sampler's log-prob calls each function served in this worker."""
        from colocate.engine.vllm_logprobs import calls
        return calls()

    def colocate_use_constraint_masks(self) -> str:
        """Our constraint masks in this worker's sampler (`vllm_trie.py`): "ours", or "vllm"."""
        from colocate.engine.vllm_trie import install
        with start_up_compiles():  # the install compiles the mask kernel (`ConstraintMasks.warm_up`)
            return install(self.model_runner)

    def colocate_masked_rows(self) -> int:
        """Logit rows our constraint masks served in this worker."""
        from colocate.engine.vllm_trie import masked_rows
        return masked_rows(self.model_runner)

    def colocate_init_sync(self, host: str, port: int, world_size: int, rank: int, timeout_s: float = 900.0) -> str:
        self.colocate_group = StatelessGroup(host, port, rank, world_size, self.device, timeout_s=timeout_s)
        return str(self.device)

    def colocate_receive_adapter(self, verify: bool = False) -> dict:
        """One broadcast from learner rank 0 -> slot -> `AdapterReceipt.to_rpc()`."""
        slot, group = self.colocate_slot, self.colocate_group
        header = torch.empty(ADAPTER_HEADER_NUMEL, dtype=torch.int64, device=self.device)
        group.broadcast(header)
        head = parse_adapter_header(header, slot.spec)
        group.broadcast(slot.flat)
        return self._colocate_apply(head, verify)

    def colocate_ipc_attach(self, desc: dict) -> str:
        """Map learner rank 0's shared ring of adapter buffers (roles on one GPU: `channel.IpcSender`)."""
        self.colocate_ipc = open_cuda_buffer(desc, self.device)  # [slots, numel]
        return str(self.device)

    def colocate_receive_ipc(self, header: list, verify: bool = False) -> dict:
        """The header came over the inference rank's gloo group; the bytes are in the version's slot
        of the shared ring. -> what `colocate_receive_adapter` returns."""
        slot, ring = self.colocate_slot, self.colocate_ipc
        head = parse_adapter_header(torch.tensor(header, dtype=torch.int64), slot.spec)
        slot.flat.copy_(ring[head.version % len(ring)])
        return self._colocate_apply(head, verify)

    def _colocate_apply(self, head, verify: bool) -> dict:
        slot = self.colocate_slot
        t0 = time.perf_counter()
        slot.apply()
        synchronize(self.device)
        apply_ms = (time.perf_counter() - t0) * 1e3
        checksum_ok = checksum(slot.flat) == head.checksum if head.checksum else None
        slot_ok = slot.matches() if verify else None
        return AdapterReceipt(head.version, head.checksum, checksum_ok, slot_ok, int(head.flags), apply_ms).to_rpc()

    def colocate_load_adapter_bytes(self, data: bytes, verify: bool = False) -> list:
        """The same update from bytes through the RPC (`Engine.load_lora`, tests)."""
        slot = self.colocate_slot
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(slot.spec.dtype)
        slot.flat.copy_(host)
        slot.apply()
        synchronize(self.device)
        return [slot.matches() if verify else None]

    def colocate_adapter_bytes(self) -> bytes:
        """The adapter last received, in the learner's dtype and layout (for checksums)."""
        return self.colocate_slot.flat.cpu().view(torch.uint8).numpy().tobytes()
