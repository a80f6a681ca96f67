"""The `Env` protocol: what the rollout worker needs from an environment.

An environment owns many groups at once (continuous batching across games). The worker loop is:

    env.start_group(group_id)               # G continuations from one fresh (or forked) state
    while groups are unfinished:
        keyed = env.requests()              # every prompt waiting for an action, across all groups
        completions = engine.generate([r for _, r in keyed])
        env.step({key: c for (key, _), c in zip(keyed, completions)})
        samples += env.pop_finished()       # Samples of fully finished groups, with rewards

Samples carry `group_key`: the worker normalizes advantages over the anchors of each key (the GRPO
group; per power within the group for Diplomacy). The env never sees the engine or the learner.
"""
from __future__ import annotations

from typing import Hashable, Protocol

from colocate.data import Completion, Request, Sample


class Env(Protocol):
    group_size: int
    """G: continuations per group."""

    def start_group(self, group_id: int) -> None:
        """Begin G continuations sharing one start state."""

    def requests(self) -> list[tuple[Hashable, Request]]:
        """All prompts now waiting for a completion, keyed."""

    def step(self, completions: dict[Hashable, Completion]) -> None:
        """Apply the completions of (a subset of) the keys from `requests`."""

    def pop_finished(self) -> list[Sample]:
        """Samples of groups whose every continuation has finished; each group is returned once."""

    def metrics(self) -> dict[str, float]:
        """Counters since the last call (e.g. invalid-order rate), namespaced by the caller."""
