"""JSON files on disk: one reader and one writer for every module that persists a record.

`read_object` returns the file's JSON object or raises the caller's error class with one line
naming the file (unreadable, corrupt, or not an object); `missing_ok` makes an absent file {}.
`write_atomic` writes beside the target and renames, so a reader never sees half a file.
Standard library only: the CLI's checks import it without torch.
"""
from __future__ import annotations

import json
import os


def read_object(path: str, error: type[Exception] = ValueError, *, name: str = "", missing_ok: bool = False) -> dict:
    """The JSON object in `path`; `error(line)` if it cannot be read or is not an object. `name`
    replaces the path in the line (e.g. the config key that pointed there)."""
    name = name or path
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise error(f"{name}: missing") from None
    except (OSError, ValueError) as e:
        raise error(f"{name}: unreadable or corrupt JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise error(f"{name}: expected a JSON object")
    return data


def write_atomic(path: str, data: dict) -> None:
    """`data` as indented JSON at `path`, written to `path.tmp` first and renamed over it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
