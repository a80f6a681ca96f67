"""The `Engine` base: sample completions for requests; take new adapter weights in place.

Contract: completions carry the sampled ids and the log-prob of each sampled token *after*
temperature and the constraint mask, i.e. what the learner computes with the same mask (vLLM:
logprobs_mode="processed_logprobs"). `load_lora` copies tensors into the live adapter: no files,
and every later `generate` samples with `version`.

An engine implements `generate`, `load_lora`, `lora_state` and `score` (the sync canary's forward,
`colocate.canary`); everything else has a default here,
so the role loops call every method unconditionally:
  * streaming (`submit` / `poll`): the rollout worker queues each game's next phase as soon as the
    game can play it. The default answers every pending request in one `generate` call per poll
    (the phase-barrier behaviour); the HF engine and vLLM override both and keep unfinished
    requests running across polls. With `rollout.update=drain` weights change only while nothing
    is pending; with `inflight` `load_lora` (or the engine's own receiver) may land between two
    polls while requests run, and each completion records the versions of its first and last
    token (`Completion.version`, `last_version`).
  * `stats`, `rng_state` / `set_rng_state` (exact resume), the profiler window: no-ops by default.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from colocate.data import Completion, Request


class Engine:
    version: int = 0
    """Adapter version the next `generate` samples with."""

    can_profile: bool = False
    """True when the engine traces its own GPU work (`start_profile` / `stop_profile`)."""

    _stream_pending: tuple[tuple[int, Request], ...] = ()
    """The default `submit` / `poll`: (ticket, request) queued and not yet answered (an instance
    attribute from the first submit on; immutable here, so no engine shares another's queue)."""
    _stream_next: int = 0
    """The next ticket."""

    def generate(self, requests: list[Request]) -> list[Completion]:
        """One completion per request, in order."""
        raise NotImplementedError

    def load_lora(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy adapter tensors (canonical names from `models.lora_state`) into the engine, in place."""
        raise NotImplementedError

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The engine's live adapter tensors (for checksums and tests)."""
        raise NotImplementedError

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """[T-1] float32 log p(token_ids[t] | token_ids[:t]), t = 1..T-1, computed by the engine's own
        forward with the adapter it samples with now (temperature 1, no mask): the sync canary."""
        raise NotImplementedError

    def start_score(self, token_ids: list[int]) -> Callable[[], torch.Tensor]:
        """`score` started now, read later: the returned function gives the log-probs, under the
        adapter the engine holds now (an engine keeps it until they are read or it takes another).
        An engine that queues requests (vLLM) runs the probe meanwhile; this default scores at once."""
        logprobs = self.score(token_ids)
        return lambda: logprobs

    # ---- optional, with defaults ---------------------------------------------------------------

    def submit(self, requests: list[Request]) -> list[int]:
        """Queue requests without waiting; -> one ticket per request."""
        first = self._stream_next
        tickets = list(range(first, first + len(requests)))
        self._stream_next = first + len(requests)
        self._stream_pending = (*self._stream_pending, *zip(tickets, requests))
        return tickets

    def poll(self, wait_all: bool = False, wake: Callable[[], bool] | None = None) -> list[tuple[int, Completion]]:
        """Completions of submitted requests, as (ticket, completion): at least one when any is
        pending (every pending one when `wait_all`); [] when nothing is pending. An engine that
        advances in steps returns early, possibly with nothing, once `wake()` is true after a step
        (the caller has other work: `Env.has_news`); this one answers everything at once."""
        pending = self._stream_pending
        if not pending:
            return []
        completions = self.generate([r for _, r in pending])
        self._stream_pending = ()  # only once answered: a failing generate keeps the queue
        return [(t, c) for (t, _), c in zip(pending, completions)]

    def stats(self) -> dict[str, float]:
        """Engine counters since the last call (TensorBoard `engine/...`)."""
        return {}

    def rng_state(self) -> list[int] | None:
        """The sampler's RNG state as JSON-able data (None: not restorable)."""
        return None

    def set_rng_state(self, state: list[int]) -> None:
        """Restore `rng_state()`'s output."""

    def start_profile(self) -> None:
        """Start the engine's own trace (only when `can_profile`)."""

    def stop_profile(self) -> None:
        """Stop it."""
