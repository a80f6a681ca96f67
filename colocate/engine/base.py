"""The `Engine` protocol: sample completions for requests; take new adapter weights in place.

Contract (DESIGN.md): completions carry the sampled ids and the log-prob of each sampled token
*after* temperature and the constraint mask, i.e. what the learner computes with the same mask
(vLLM: logprobs_mode="processed_logprobs"). `load_lora` copies tensors into the live adapter: no
files, and every later `generate` samples with `version`.
"""
from __future__ import annotations

from typing import Protocol

import torch

from colocate.data import Completion, Request


class Engine(Protocol):
    version: int
    """Adapter version the next `generate` samples with."""

    def generate(self, requests: list[Request]) -> list[Completion]:
        """One completion per request, in order."""

    def load_lora(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy adapter tensors (canonical names from `models.lora_state`) into the engine, in place."""

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The engine's live adapter tensors (for checksums and tests)."""
