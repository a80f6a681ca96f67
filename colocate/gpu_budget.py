"""The memory split of a GPU that an inference rank (vLLM) and a learner rank share.

vLLM takes `engine.gpu_memory_utilization` of the card for its weights, CUDA graphs and KV cache;
the learner needs the rest for its own copy of the base weights, the adapter with its AdamW state,
the activations of one micro-batch and the logits at its completion positions. Both are checked
at start-up, before any weights load (the first rank to allocate would otherwise leave the other
an out-of-memory error minutes later), and the split is printed once. The learner figure is an
estimate from the model's shape (`learner_bytes`); it errs high, so a refused split may still
have run, but an accepted one leaves headroom.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from colocate.config import Config, ConfigError

GIB = 1 << 30
CONTEXT_BYTES = 1 * GIB
"""Per process: the CUDA context, cuBLAS workspaces, the allocator's fragmentation."""
ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER = 34
"""bf16 activations a decoder layer keeps for backward per token and hidden unit without
recomputation (Korthikanti et al. 2022, flash attention: no sequence-squared term)."""


@dataclass
class Split:
    total: int
    engine: int
    engine_weights: int
    learner: int
    learner_parts: dict

    def line(self, shared_by: str) -> str:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.learner_parts.items())
        return (f"colocate: one GPU of {self.total / GIB:.1f} GiB shared by {shared_by}: vLLM "
                f"{self.engine / GIB:.1f} GiB (engine.gpu_memory_utilization), learner ~{self.learner / GIB:.1f} GiB "
                f"({parts}), {(self.total - self.engine - self.learner) / GIB:.1f} GiB to spare")


def learner_bytes(cfg: Config, model) -> dict[str, int]:
    """The learner's peak by part, from the (meta-device) base model's shape."""
    dtype_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
    c = model.config
    weights = sum(p.numel() for p in model.parameters()) * dtype_bytes
    lora_params = sum(cfg.lora.rank * (m.in_features + m.out_features) for name, m in model.named_modules()
                      if name.rpartition(".")[2] in cfg.lora.target_modules and isinstance(m, torch.nn.Linear))
    tokens = cfg.learner.micro_batch_tokens
    layers_kept = 1 if cfg.learner.activation_checkpointing else c.num_hidden_layers
    acts = tokens * c.hidden_size * (ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER * layers_kept
                                     + (2 * c.num_hidden_layers if cfg.learner.activation_checkpointing else 0))
    return {"weights": weights, "adapter+AdamW": lora_params * 16, "activations": acts,
            "logits": tokens * c.vocab_size * 4, "context": CONTEXT_BYTES}


def gpu_total_bytes(index: int = 0) -> int | None:
    """The card's memory from NVML (no CUDA context is made here); None when NVML is unavailable."""
    try:
        import pynvml
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = int(visible.split(",")[index]) if visible else index
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(physical)).total)
    except Exception:  # no driver, a MIG or UUID device list: the check is skipped, not the run
        return None


def plan_split(cfg: Config, model, total: int) -> Split:
    parts = learner_bytes(cfg, model)
    engine_weights = parts["weights"] * (2 if cfg.engine.lora_mode == "merged" else 1)  # merged keeps W0 too
    return Split(total, int(cfg.engine.gpu_memory_utilization * total), engine_weights, sum(parts.values()), parts)


def check_split(split: Split) -> None:
    """ConfigError (one line, the numbers in it) when either side cannot fit."""
    if split.engine < split.engine_weights + CONTEXT_BYTES:
        raise ConfigError(f"engine.gpu_memory_utilization gives vLLM {split.engine / GIB:.1f} GiB, less than its "
                          f"weights ({split.engine_weights / GIB:.1f} GiB) plus room for a KV cache; raise it")
    if split.engine + split.learner > split.total:
        raise ConfigError(f"one GPU of {split.total / GIB:.1f} GiB cannot hold vLLM's {split.engine / GIB:.1f} GiB "
                          f"(engine.gpu_memory_utilization) and the learner's ~{split.learner / GIB:.1f} GiB "
                          f"({', '.join(f'{k} {v / GIB:.1f}' for k, v in split.learner_parts.items())}); lower "
                          "engine.gpu_memory_utilization or learner.micro_batch_tokens, or set "
                          "learner.activation_checkpointing=true")


def check_gpu_budget(cfg: Config, model, processes_per_gpu: int) -> None:
    """Start-up, when ranks share GPUs: refuse a split that cannot fit, else print it (rank 0)."""
    total = gpu_total_bytes()
    if total is None:
        return
    split = plan_split(cfg, model, total)
    check_split(split)
    if int(os.environ.get("RANK", "0")) == 0:
        print(split.line(f"{processes_per_gpu} processes (an inference and a learner rank)"), file=sys.stderr,
              flush=True)
