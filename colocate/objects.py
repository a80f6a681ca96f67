"""Objects named in a config by path, "my_pkg.module:name" (custom env classes, reward functions).

The module is imported the ordinary way (it must be importable: installed, or on PYTHONPATH, or
under the directory the job starts in), so a user's code needs no registration with colocate.
"""
from __future__ import annotations

import importlib
import os
import sys


class ObjectPathError(ValueError):
    """The path names nothing importable; the message says what is missing."""


def load_object(path: str):
    """The object at "module.sub:attr" (attr may be dotted: "module:Class.method")."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ObjectPathError(f"{path!r} is not a path like 'my_pkg.module:name'")
    if os.getcwd() not in sys.path and "" not in sys.path:  # `python -m` puts the cwd first; torchrun too
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ObjectPathError(f"{path!r}: cannot import {module_name!r} ({e})") from None
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ObjectPathError(f"{path!r}: module {module_name!r} has no {attr!r}") from None
    return obj
