"""Launch overrides are plain dicts: a misspelt key must raise, naming the key it was meant to be."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


def nearest_key(key: str, valid: list[str]) -> str:
    """The valid key closest to a misspelt one."""
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return match[0] if match else valid[0]


def check_keys(what: str, given: Iterable[str], valid: list[str]) -> None:
    """Raise ValueError for the first key of `given` not in `valid` (a typo would be ignored silently)."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(f"{what}: unknown key {unknown[0]!r} (did you mean {nearest_key(unknown[0], valid)!r}?); "
                         f"keys: {', '.join(valid)}")
