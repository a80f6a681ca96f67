"""The `Engine` protocol: sample completions for requests; take new adapter weights in place.

Contract (DESIGN.md): completions carry the sampled ids and the log-prob of each sampled token
*after* temperature and the constraint mask, i.e. what the learner computes with the same mask
(vLLM: logprobs_mode="processed_logprobs"). `load_lora` copies tensors into the live adapter: no
files, and every later `generate` samples with `version`.

Streaming (`submit` / `poll`): the rollout worker queues each game's next phase as soon as the
game can play it. An engine without a streaming path inherits `GenerateStream`: every poll
samples all pending requests in one `generate` call, which is the phase-barrier behaviour.
Weights change only while nothing is pending (the worker drains before each adapter update).
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

    def submit(self, requests: list[Request]) -> list[int]:
        """Queue requests without waiting; -> one ticket per request."""

    def poll(self, wait_all: bool = False) -> list[tuple[int, Completion]]:
        """Completions of submitted requests, as (ticket, completion): at least one when any is
        pending (every pending one when `wait_all`); [] when nothing is pending."""

    def load_lora(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy adapter tensors (canonical names from `models.lora_state`) into the engine, in place."""

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The engine's live adapter tensors (for checksums and tests)."""


class GenerateStream:
    """`submit` / `poll` on top of `generate`: one batch of everything pending per poll. The queue
    lives on the instance, created by the first `submit` (engines keep their own __init__)."""

    def submit(self, requests: list[Request]) -> list[int]:
        if not hasattr(self, "_stream_pending"):
            self._stream_pending: list[tuple[int, Request]] = []
            self._stream_next = 0
        tickets = list(range(self._stream_next, self._stream_next + len(requests)))
        self._stream_next += len(requests)
        self._stream_pending.extend(zip(tickets, requests))
        return tickets

    def poll(self, wait_all: bool = False) -> list[tuple[int, Completion]]:
        pending = getattr(self, "_stream_pending", [])
        if not pending:
            return []
        completions = self.generate([r for _, r in pending])
        self._stream_pending = []  # only once answered: a failing generate keeps the queue
        return [(t, c) for (t, _), c in zip(pending, completions)]
