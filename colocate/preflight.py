"""Checks of what a valid config points at, before any process group or model exists.

`config.validate` checks values (types, ranges, cross-field rules); this checks the world they name:
the run directory can be written, a model directory holds a `config.json` that parses, the
Diplomacy state cache loads, and every LoRA target module exists in the model. Each failure is one
`ConfigError` line naming the key, which `train.py` prints before exiting with code 2; the same
checks run for `python -m colocate.train --config X --check`.
"""
from __future__ import annotations

import json
import os
import tempfile

from colocate.config import Config, ConfigError


def check_run_dir(run_dir: str) -> None:
    """metrics.run_dir must be writable, or creatable under its nearest existing parent
    (checkpoints, summaries and events go there). Nothing is created here."""
    existing = os.path.abspath(run_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"metrics.run_dir={run_dir!r}: {existing} is a file, not a directory")
    try:  # a real write: permission bits do not tell root about read-only mounts
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"metrics.run_dir={run_dir!r}: {existing} is not writable ({e.strerror or e})") from None


def check_model_dir(path: str) -> None:
    """model.path: a directory with a config.json that is a JSON object."""
    if not path:
        return
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ConfigError(f"model.path={path!r} has no config.json (a Hugging Face model directory is expected)")
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={path!r}: config.json does not parse ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.path={path!r}: config.json is not a JSON object")


def check_state_cache(cfg: Config) -> None:
    """env.state_cache (Diplomacy): the file exists and every line is a saved game state."""
    if cfg.env.name != "diplomacy" or not cfg.env.state_cache:
        return
    from colocate.envs.diplomacy.game import StateCacheError, load_state_cache
    try:
        load_state_cache(cfg.env.state_cache)
    except (OSError, StateCacheError) as e:
        raise ConfigError(f"env.state_cache={cfg.env.state_cache!r}: {e}") from None


def meta_model(cfg: Config):
    """The base model on the meta device (no memory): its module names and sizes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from colocate.models import model_config
    config = AutoConfig.from_pretrained(cfg.model.path) if cfg.model.path else \
        model_config(cfg.model.shape, 1024, cfg.model.dtype)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def model_module_names(cfg: Config) -> set[str]:
    """The last name component of every module of the base model."""
    return {name.rpartition(".")[2] for name, _ in meta_model(cfg).named_modules()}


def check_lora_targets(cfg: Config) -> None:
    """lora.target_modules: each names modules of the model (peft would fail later, deep inside)."""
    import difflib
    names = model_module_names(cfg)
    for target in cfg.lora.target_modules:
        if target not in names:
            near = difflib.get_close_matches(target, sorted(names), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"lora.target_modules: {target!r} is no module of the model{hint}")


def check_placement(cfg: Config, world: int | None, local_world: int | None) -> None:
    """topology.placement against the world torchrun gives (WORLD_SIZE, LOCAL_WORLD_SIZE), and which
    ranks share a GPU (`topology.check_shared_gpus`)."""
    from colocate.topology import check_shared_gpus, place_roles, rank_devices
    if world is None:
        return
    try:
        roles = place_roles(cfg, world, local_world or world)
        if gpu_count(cfg):
            check_shared_gpus(roles, rank_devices(world, local_world or world, gpu_count(cfg)))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def gpu_count(cfg: Config) -> int:
    """GPUs the ranks will use (0: the job runs on CPUs)."""
    import torch
    if cfg.sync.backend == "gloo" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def preflight(cfg: Config, world: int | None = None, local_world: int | None = None) -> None:
    check_placement(cfg, world, local_world)
    if world is not None and gpu_count(cfg) and (local_world or world) > gpu_count(cfg):
        from colocate.gpu_budget import check_gpu_budget
        check_gpu_budget(cfg, meta_model(cfg), processes_per_gpu=-(-(local_world or world) // gpu_count(cfg)))
    check_run_dir(cfg.metrics.run_dir)
    check_model_dir(cfg.model.path)
    check_state_cache(cfg)
    check_lora_targets(cfg)
