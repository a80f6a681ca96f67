"""Launch overrides are plain dicts: a misspelt key must raise, naming it and the keys there are.

(The config's "did you mean" guess lives in colocate's config checks; this package imports nothing of
colocate, and a launch override has a handful of keys, all listed in the message.)"""
from __future__ import annotations

from collections.abc import Iterable


def check_keys(what: str, given: Iterable[str], valid: list[str]) -> None:
    """Raise ValueError for the first key of `given` not in `valid` (a typo would be ignored silently)."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(f"{what}: unknown key {unknown[0]!r}; keys: {', '.join(valid)}")
