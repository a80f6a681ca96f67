"""The engine table: `engine.kind` -> an `EngineEntry` (torchtitan's `TrainSpec`, `envs.BUILTIN`'s
counterpart), which says how to build the engine and its adapter receiver on an inference rank,
how learner rank 0 sends adapters to it, whether it loads its own weights, and whether it can run
here (`engine.kind: auto` takes the first entry of `AUTO_ORDER` that can). `train.py` and
`preflight.py` look entries up here and never branch on a kind.

vLLM is imported only inside the vLLM entry's functions (it is not installed on CPU machines).
An engine whose rank starts a server early (vLLM's engine core forkserver, `engine.prestart`)
registers it in `headstart.SERVERS` too: the rank starts it before it imports torch (which this
table imports); the launcher's word (`preimport_ranks`) names the GPU.
Ranks that share a GPU always move adapters by CUDA IPC (`channel.IpcSender`), whichever engine.
"""
from __future__ import annotations

import importlib
import importlib.util
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from colocate.channel import (AdapterReceiver, AdapterSender, BroadcastReceiver, BroadcastSender, IpcReceiver,
                              IpcSender, NoSender)
from colocate.config_checks import ConfigError, nearest_key
from colocate.engine.base import Engine
from colocate.engine.fp8_merge import check_fp8_device
from colocate.engine.headstart import SERVERS, EngineWord
from colocate.startup import mark
from colocate.topology import rank_devices
from colocate.wire import LoraSpec


@dataclass(frozen=True)
class EngineParts:
    """What an inference rank hands an engine entry's `build`: the rank's model (on the meta device
    when the entry loads its own weights), its tokenizer, and the env's facts that size an engine
    (`envs.env_facts`: prompt_bound, requests_per_group)."""
    model: object
    tokenizer: object
    env_facts: dict


@dataclass(frozen=True)
class EngineEntry:
    """One engine kind: everything the composition root needs to know about it."""
    build: Callable[..., tuple[Engine, AdapterReceiver]]
    """(cfg, topo, parts: EngineParts) -> the engine and the receiving end of its adapter channel;
    it marks `engine_constructed` (`startup.mark`) once the engine is built, before the receiver
    (which may wait for learner rank 0)."""
    sender: Callable[..., AdapterSender]
    """(cfg, topo, spec, before_join) -> learner rank 0's sender when no engine shares its GPU;
    `before_join()` runs once whatever the engines wait for is published, before waiting for them."""
    loads_own_weights: bool = False
    """True: the engine reads the model directory itself, so its rank builds the policy on meta."""
    available: Callable[..., bool] = lambda topo: True
    """(topo) -> whether `engine.kind: auto` may pick it on this rank's device."""
    installed: Callable[[], bool] = lambda: True
    """Whether the packages it needs are importable (`preflight` checks an explicit kind)."""
    install_hint: str = ""
    """What to do when it is not installed (the preflight line's end)."""
    sizes_from_free_memory: Callable[..., bool] = lambda cfg: False
    """(cfg) -> whether the engine sizes its memory from what the GPU has free while it starts (vLLM's
    memory profile, without `engine.kv_cache_gib`): a learner on its GPU then allocates only once it
    has started, since the profile would count the learner's memory as the engine's own."""
    imports: tuple[str, ...] = ()
    """Modules its `build` imports that take long (vLLM's): an inference rank of `colocate train`
    imports them while it waits for the launcher's checks (`preimport`)."""
    check_devices: Callable[..., None] = lambda cfg, gpus: None
    """(cfg, gpus) -> ConfigError where this machine's `gpus` GPUs cannot run the config's engine
    (`preflight`, before any model is built)."""


def build_hf(cfg, topo, parts: EngineParts) -> tuple[Engine, AdapterReceiver]:
    """The reference engine on the rank's device, in the rank's process: adapters arrive by
    broadcast (or CUDA IPC when it shares learner rank 0's GPU)."""
    from colocate.engine.hf import HFEngine
    engine = HFEngine(parts.model, parts.tokenizer, device=topo.device, seed=cfg.rollout.seed * 1000 + topo.rank,
                      quantization=cfg.engine.quantization, lora_mode=cfg.engine.lora_mode)
    mark("engine_constructed")  # before the receiver, which waits for learner rank 0
    spec = LoraSpec.of(engine.lora_state())
    if topo.shared_gpu:
        return engine, IpcReceiver(engine, spec, src=topo.sync_src, group=topo.sync_group, rank=topo.rank,
                                   device=topo.device)
    return engine, BroadcastReceiver(engine, spec, src=topo.sync_src, group=topo.sync_group, device=topo.device)


def broadcast_sender(cfg, topo, spec: LoraSpec, before_join: Callable[[], None]) -> AdapterSender:
    """An adapter broadcast on the sync group (engines whose weights live in the rank's process)."""
    before_join()
    return BroadcastSender(spec, src=topo.sync_src, group=topo.sync_group, with_checksum=cfg.sync.check_checksum)


def build_vllm(cfg, topo, parts: EngineParts) -> tuple[Engine, AdapterReceiver]:
    """A vLLM engine; its workers receive adapters on their own NCCL group (or by CUDA IPC)."""
    from colocate.engine import vllm_channel
    from colocate.engine.vllm import VLLMEngine
    from colocate.models import lora_state
    spec = LoraSpec.of(lora_state(parts.model))  # the rank's meta model: the learner's layout, not built again
    if topo.shared_gpu:  # learner rank 0 shares its buffer once the engine is up
        engine = VLLMEngine.from_config(cfg, topo, parts.tokenizer, spec, **parts.env_facts)
        mark("engine_constructed")  # before the receiver, which waits for learner rank 0
        return engine, vllm_channel.VLLMIpcReceiver(engine, topo, verify=cfg.sync.check_checksum)
    endpoint = vllm_channel.receive_endpoint(topo)  # learner rank 0 publishes it, then waits for the engines
    engine = VLLMEngine.from_config(cfg, topo, parts.tokenizer, spec, **parts.env_facts)
    mark("engine_constructed")
    return engine, vllm_channel.join_receiver(cfg, topo, engine, endpoint)


def vllm_sender(cfg, topo, spec: LoraSpec, before_join: Callable[[], None]) -> AdapterSender:
    """Publishes the group's endpoint, runs `before_join`, then waits until every engine's worker
    has joined the NCCL group."""
    from colocate.engine import vllm_channel
    return vllm_channel.open_sender(cfg, topo, spec, before_join=before_join)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


ENGINES: dict[str, EngineEntry] = {
    "hf": EngineEntry(build=build_hf, sender=broadcast_sender),
    "vllm": EngineEntry(build=build_vllm, sender=vllm_sender, loads_own_weights=True,
                        available=lambda topo: topo.device.type == "cuda" and vllm_installed(),
                        installed=vllm_installed, install_hint="pip install vllm, or set engine.kind=hf / auto",
                        sizes_from_free_memory=lambda cfg: cfg.engine.kv_cache_gib <= 0,
                        imports=("vllm.entrypoints.llm", "colocate.engine.vllm", "colocate.engine.vllm_channel"),
                        check_devices=check_fp8_device),
}
"""engine.kind -> its entry; a new engine registers here (DEVELOPERS.md, "Adding things")."""

AUTO_ORDER = ("vllm", "hf")
"""`engine.kind: auto` takes the first of these that is `available`; the last always is."""


def engine_kinds() -> tuple[str, ...]:
    """What engine.kind may be."""
    return ("auto", *ENGINES)


def resolve_kind(kind: str, topo) -> str:
    """engine.kind with auto resolved; every rank resolves it alike (learner rank 0 must know how
    adapters travel)."""
    if kind != "auto":
        return kind
    return next(k for k in AUTO_ORDER if k in ENGINES and ENGINES[k].available(topo))


def engine_entry(cfg, topo) -> EngineEntry:
    """The entry of the run's engine on this rank."""
    return ENGINES[resolve_kind(cfg.engine.kind, topo)]


def on_device(kind: str) -> SimpleNamespace:
    """What `resolve_kind` and `EngineEntry.available` read of a topology: its device's kind."""
    import torch
    return SimpleNamespace(device=torch.device(kind))


def preimport_ranks(kind: str, roles: list[str], gpus: int, prestart: bool = False,
                    local_world: int | None = None) -> str:
    """What `colocate train` tells its ranks (`handover.ENGINE_IMPORTS_ENV`, an `EngineWord`):
    engine.kind (`auto` resolved as the checks resolve it, for the `gpus` per node the ranks will
    use) and the ranks of `roles` (the world, `local_world` ranks per node; None: one node) that
    infer, with the GPU index of each one's engine (`topology.rank_devices`) when that engine
    starts a server early (`headstart.SERVERS`), the config wants it (`engine.prestart`) and there
    are GPUs; "" when that engine has nothing to import early."""
    kind = resolve_kind(kind, on_device("cuda" if gpus else "cpu"))
    if kind not in ENGINES or not ENGINES[kind].imports:
        return ""
    ranks = tuple(r for r, role in enumerate(roles) if role == "inference")
    devices = rank_devices(len(roles), local_world or len(roles), gpus)
    servers = tuple(devices[r][1] for r in ranks) if prestart and gpus and kind in SERVERS else ()
    return str(EngineWord(kind, ranks, servers))


def preimport(word: str, rank: int) -> threading.Thread | None:
    """On a rank the launcher's `word` (`preimport_ranks`) names: its engine's `imports` on a daemon
    thread, started while the rank waits for the launcher's checks, so the engine's build finds them
    imported -> the thread (`train.run_rank` joins it once the world is formed, before the rank
    imports anything else: two threads importing modules that import each other can deadlock),
    else None (a learner never imports an engine's modules). The engine's server, where the word
    names one, the rank started already (`headstart.head_start`). A refused launch ends the rank
    mid-import; a failed import is the build's to raise."""
    parsed = EngineWord.parse(word)
    if parsed.kind not in ENGINES or rank not in parsed.ranks:
        return None
    thread = threading.Thread(target=import_early, args=(ENGINES[parsed.kind],), name="colocate-engine-imports",
                              daemon=True)
    thread.start()
    return thread


def import_early(entry: EngineEntry) -> None:
    """`entry.imports`, where the entry is available on this rank's device (the device its topology
    will take when CUDA works: else the rank's engine is another one, or fails to start on its own);
    a module that fails to import is raised again by the build's own import."""
    import torch
    try:
        if not entry.available(on_device("cuda" if torch.cuda.is_available() else "cpu")):
            return
        for name in entry.imports:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a head start only: the build raises it again on the rank's thread
        pass


def check_engine_kind(kind: str, *, outside_world: bool = True) -> None:
    """engine.kind names an entry (or auto), and (`outside_world`) what the entry needs is installed."""
    if kind not in engine_kinds():
        raise ConfigError(f"engine.kind={kind!r} is not one of {', '.join(map(repr, engine_kinds()))}; "
                          f"did you mean {nearest_key(str(kind), list(engine_kinds()))!r}?")
    if outside_world and kind != "auto" and not ENGINES[kind].installed():
        raise ConfigError(f"engine.kind={kind} but {kind} is not installed in this environment "
                          f"({ENGINES[kind].install_hint})")


def check_engine_devices(cfg, gpus: int) -> None:
    """The run's engine entry (`auto` resolved as the checks resolve it, for `gpus` GPUs) checks this
    machine's GPUs (`EngineEntry.check_devices`)."""
    kind = resolve_kind(cfg.engine.kind, on_device("cuda" if gpus else "cpu"))
    if kind in ENGINES:
        ENGINES[kind].check_devices(cfg, gpus)


def make_sender(cfg, topo, spec: LoraSpec, before_join: Callable[[], None] = lambda: None) -> AdapterSender:
    """The sending end of the adapter channel: learner rank 0 sends, the other learners do not.
    `before_join()` (the learner's warm-up) runs on every learner while the engines start. On a GPU
    shared with them it runs beside the ring's handshake (which waits for the engines to be up)
    unless the engine sizes its memory from the GPU's free memory at start
    (`EngineEntry.sizes_from_free_memory`): then after it, or vLLM's start-up profile would count
    the warm-up's memory as its own."""
    if topo.rank != topo.sync_src:
        before_join()
        return NoSender()
    if topo.shared_gpu:  # every engine on this GPU: CUDA IPC, whichever engine
        early = not engine_entry(cfg, topo).sizes_from_free_memory(cfg)
        sender = IpcSender(spec, src=topo.sync_src, group=topo.sync_group, device=topo.device,
                           slots=cfg.learner.max_policy_lag + 1, with_checksum=cfg.sync.check_checksum,
                           background=early)
        before_join()  # early: beside the handshake; else past the ring's barrier (the engines are up)
        return sender
    return engine_entry(cfg, topo).sender(cfg, topo, spec, before_join)
