"""The learner role's checkpoints (the format is `colocate.checkpoint`'s): every learner joins the
optimizer-state gather and learner rank 0 writes one (`write_checkpoint`), a resumed run puts one
back into the `Learner` (`restore_learner`), and a stop on collapse or canary mismatch names the
last good one (`note_last_good`)."""
from __future__ import annotations

import os

import torch
import yaml
from torch.distributed.tensor import DTensor, distribute_tensor

from colocate.config import Config, to_dict
from colocate.jsonfile import write_atomic
from colocate.lifecycle import Faults
from colocate.metrics import MetricsWriter
from colocate.models import canonical_name
from colocate.topology import Topology
from colocate.wire import recv_json


def restore_learner(learner, resume: dict) -> int:
    """Adapter, optimizer and RNG from a checkpoint; returns the step to continue from."""
    from colocate.checkpoint import check_adapter_matches, unflatten_optimizer
    live = {canonical_name(n): p for n, p in learner.model.named_parameters() if "lora_" in n}
    check_adapter_matches(resume["adapter"], live, resume["path"])
    with torch.no_grad():
        for name, param in live.items():
            src = resume["adapter"][name]
            if isinstance(param, DTensor):  # an FSDP2 shard
                src = distribute_tensor(src.to(param.dtype), param.device_mesh, param.placements)
            param.copy_(src)
    params = [p for group in learner.optimizer.param_groups for p in group["params"]]
    learner.optimizer.load_state_dict(unflatten_optimizer(resume["optimizer_tensors"], resume["optimizer_meta"], params))
    torch.set_rng_state(resume["rng"]["torch_cpu"])
    learner.version = resume["trainer_state"]["version"]
    return resume["trainer_state"]["step"]


def write_checkpoint(cfg: Config, topo: Topology, learner, adapter: dict, history: dict, step: int,
                     faults: Faults, protect_step: int | None = None) -> None:
    """Every learner joins the optimizer-state gather; learner rank 0 collects the inference ranks'
    states and writes the checkpoint atomically (with the base model's identity in its manifest)."""
    from colocate.checkpoint import (CheckpointState, checkpoint_root, flatten_optimizer, peft_config_dict,
                                     save_checkpoint)
    # Gathering DTensor optimizer state (FSDP2) is a collective: every learner flattens it.
    optimizer_state = flatten_optimizer(learner.optimizer.state_dict())
    if topo.rank != topo.sync_src:
        return
    inference = {str(r): recv_json(r, topo.transport_group) for r in topo.inference_ranks}
    trainer_state = {"step": step, "version": learner.version, "history": history, "inference": inference}
    state = CheckpointState(adapter, peft_config_dict(learner.model), optimizer_state,
                            {"torch_cpu": torch.get_rng_state()}, trainer_state,
                            yaml.safe_dump(to_dict(cfg), sort_keys=False), base=learner.base)
    path = save_checkpoint(checkpoint_root(cfg.metrics.run_dir), step, state, keep=cfg.checkpoint.keep,
                           faults=faults, protect_step=protect_step)
    print(f"[learner] checkpoint written: {path}", flush=True)


def note_last_good(cfg: Config, writer: MetricsWriter, good_step: int, step: int, why: str) -> None:
    """<run_dir>/checkpoints/last_good.json: the newest checkpoint at or before `good_step` (a
    collapse: the monitor's last step before the drop; a canary mismatch: the step before the
    engine's samples were trained on), and one line saying which."""
    from colocate.checkpoint import checkpoint_root, checkpoints
    root = checkpoint_root(cfg.metrics.run_dir)
    good = [p for p in checkpoints(root) if checkpoint_step(p) <= good_step]  # newest first
    path = good[0] if good else None
    write_atomic(os.path.join(root, "last_good.json"),
                 {"path": path, "step": checkpoint_step(path) if path else None, f"{why}_step": step})
    writer.print(f"{why} at step {step}: last good checkpoint {path or 'none (set checkpoint.every)'}")


def checkpoint_step(path: str) -> int:
    return int(os.path.basename(path).rpartition("-")[2])
