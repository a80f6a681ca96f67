"""Checks of what a valid config points at, before any process group or model exists.

`config_checks.validate` checks values (types, ranges, cross-field rules); this checks the world they name:
the run directory can be written, a model directory holds a `config.json` that parses, the env's
own rules and what they point at hold (`envs.check_env`: the env class's `check` and `preflight`
hooks, e.g. the dataset env's files and reward functions, the Diplomacy state cache, an agent's
tools), and every LoRA target module exists in the model. Each failure is one
`ConfigError` line naming the key, which `rank_config.configure` prints before exiting with code 2; the
same checks run for `colocate check` and `python -m colocate.train --config X --check`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
import tempfile

from colocate.config import Config, ConfigError
from colocate.jsonfile import read_object
from colocate.startup import check_phase


def check_run_dir(run_dir: str) -> None:
    """metrics.run_dir must be writable, or creatable under its nearest existing parent
    (checkpoints, summaries and events go there). Nothing is created here."""
    check_writable_dir(f"metrics.run_dir={run_dir!r}", run_dir)


def check_writable_dir(what: str, path: str) -> None:
    """`path` is a directory that can be written, or can be created under its nearest existing
    parent; `what` names it in the error (a key, or a flag: `--out='x'`)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{what}: {existing} is a file, not a directory")
    try:  # a real write: permission bits do not tell root about read-only mounts
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{what}: {existing} is not writable ({e.strerror or e})") from None


def check_model_dir(path: str) -> None:
    """model.path: a local directory with a config.json that is a JSON object."""
    if not path:
        return
    if not os.path.isdir(path):
        raise ConfigError(f"model.path={path!r} is not a local directory (nothing is downloaded)")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ConfigError(f"model.path={path!r} has no config.json (a Hugging Face model directory is expected)")
    read_object(file, ConfigError, name=f"model.path={path!r}: config.json")


def meta_model(cfg: Config):
    """The base model on the meta device (no memory): its module names and sizes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from colocate.models import model_config
    config = AutoConfig.from_pretrained(cfg.model.path) if cfg.model.path else \
        model_config(cfg.model.shape, 1024, cfg.model.dtype)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_lora_targets(cfg: Config, model) -> None:
    """lora.target_modules: each names modules of the (meta-device) model (peft would fail later,
    deep inside)."""
    import difflib
    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    for target in cfg.lora.target_modules:
        if target not in names:
            near = difflib.get_close_matches(target, sorted(names), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"lora.target_modules: {target!r} is no module of the model{hint}")


def check_model_len(cfg: Config, model) -> None:
    """engine.max_model_len within the model's positions (`max_position_embeddings` of model.path's
    config.json or of model.shape): a longer context would run past its position embeddings."""
    from colocate.gpu_budget import model_name
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and cfg.engine.max_model_len > positions:
        raise ConfigError(f"engine.max_model_len={cfg.engine.max_model_len} exceeds the {positions} positions of "
                          f"{model_name(cfg)} (max_position_embeddings); set it to at most {positions}, or 0 to size it "
                          "from the workload")


def check_placement(cfg: Config, world: int | None, local_world: int | None, gpus: int) -> None:
    """topology.placement against the world torchrun gives (WORLD_SIZE, LOCAL_WORLD_SIZE), and which
    ranks share one of the `gpus` GPUs (`topology.check_shared_gpus`)."""
    from colocate.topology import check_shared_gpus, place_roles, rank_devices
    if world is None:
        return
    try:
        roles = place_roles(cfg, world, local_world or world)
        if gpus:
            check_shared_gpus(roles, rank_devices(world, local_world or world, gpus))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def gpu_count(cfg: Config) -> int:
    """GPUs the ranks will use (0: the job runs on CPUs). Counted through NVML
    (`torch.cuda.device_count`), which leaves CUDA uninitialised: `torch.cuda.is_available` would
    initialise the driver (cuInit) in the launcher's checking child, seconds on a large GPU before
    any rank starts; CUDA's own count is the fallback where NVML is missing."""
    import torch
    if cfg.sync.backend == "gloo":
        return 0
    return torch.cuda.device_count()


@dataclass(frozen=True)
class CardSpec:
    """`colocate check --gpu-memory SIZE [--gpus-per-node G]`: plan for a card this machine may not have."""
    memory: str
    """80GiB, 80GB, 81559MiB, or a card's name (`gpu_budget.CARDS`)."""
    gpus_per_node: int | None = None
    """GPUs per node; None: one per rank (more ranks than GPUs share them round-robin, as a run does)."""


def the_card(card: CardSpec | None, gpus: int, local_world: int):
    """The GPUs to plan memory for: `card` (a check for another machine), else this machine's (NVML),
    else None (CPU ranks)."""
    from colocate.gpu_budget import GIB, Card, gpu_memory_unit, gpu_total_bytes
    if card is not None:
        per_node = card.gpus_per_node or local_world
        total, read = gpu_memory_unit(card.memory)
        return Card(total, per_node, f"{per_node} GPUs per node of {read}")
    total = gpu_total_bytes() if gpus else None
    return Card(total, gpus, f"this machine's GPUs, {total / GIB:.1f} GiB each") if total else None


def plan_memory(cfg: Config, model, world: int | None, local_world: int | None, card: CardSpec | None,
                gpus: int, show: bool):
    """`gpu_budget.plan_memory` over the ranks' placement: `auto` resolved, every GPU checked, the
    plan printed where `show` (rank 0 of a run) -> the `gpu_budget.MemoryPlan` (each rank's estimate
    in GiB, {} on CPU; the learners' micro_batch_tokens)."""
    from colocate.gpu_budget import check_host_memory, host_memory_bytes, plan_memory as plan, print_plan
    from colocate.topology import place_roles, rank_devices
    world = world or 2
    local_world = local_world or world
    roles = place_roles(cfg, world, local_world)
    planned = the_card(card, gpus, local_world)
    if card is None and not gpus and host_memory_bytes():  # ranks on CPUs: their weights in this host's memory
        check_host_memory(cfg, model, roles, local_world, host_memory_bytes())
    memory = plan(cfg, model, roles, rank_devices(world, local_world, planned.per_node) if planned else None, planned)
    if show:
        print_plan(memory.lines)
    return memory


def preflight(cfg: Config, world: int | None = None, local_world: int | None = None,
              card: CardSpec | None = None, show_plan: bool = False):
    """Every check of the world the config names, then the memory plan (`plan_memory`), which it
    returns; `cfg` is not changed (the plan holds `auto` resolved)."""
    # torch comes with the envs and the engines: imported here, not with this module (whose CardSpec
    # the launcher takes before the config is parsed: a bad key is refused before torch is imported)
    from colocate.engine.table import check_engine_devices, check_engine_kind
    from colocate.envs import check_env
    check_phase("check_imports")  # each phase's end: the launcher's record of where its checks' seconds go
    gpus = gpu_count(cfg)
    check_phase("gpu_count")
    check_placement(cfg, world, local_world, gpus)
    check_run_dir(cfg.metrics.run_dir)
    check_model_dir(cfg.model.path)
    check_phase("paths")
    check_env(cfg)  # the env's own rules and what they point at (its `check` and `preflight` hooks)
    check_phase("env")
    # the engine table's entry; `--gpu-memory` plans for another machine, whose packages are not this one's
    check_engine_kind(cfg.engine.kind, outside_world=card is None)
    if card is None:  # this machine's GPUs (a planned card's are not here to read)
        check_engine_devices(cfg, gpus)
    check_phase("engine")
    model = meta_model(cfg)  # once: its module names and its size
    check_lora_targets(cfg, model)
    check_model_len(cfg, model)
    check_phase("meta_model")
    plan = plan_memory(cfg, model, world, local_world, card, gpus, show_plan)
    check_phase("memory_plan")
    return plan
