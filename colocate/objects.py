"""Objects named in a config by path, "my_pkg.module:name" (custom env classes, reward functions).

The module is imported the ordinary way (it must be importable: installed, or on PYTHONPATH, or
under the directory the job starts in), so a user's code needs no registration with colocate.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback


class ObjectPathError(ValueError):
    """The path names nothing importable; the message says what is missing."""


def load_object(path: str):
    """The object at "module.sub:attr" (attr may be dotted: "module:Class.method")."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ObjectPathError(f"{path!r} is not a path like 'my_pkg.module:name'")
    if os.getcwd() not in sys.path and "" not in sys.path:  # `python -m` puts the cwd first; torchrun too
        sys.path.insert(0, os.getcwd())
    obj = import_user_module(path, module_name)
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ObjectPathError(f"{path!r}: module {module_name!r} has no {attr!r}") from None
    return obj


def import_user_module(path: str, module_name: str):
    """Import a user's module; whatever goes wrong (not found, a syntax error, an exception while it
    runs) becomes one `ObjectPathError` line naming the module, the error and where it happened."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):  # it, or its package
            raise ObjectPathError(f"{path!r}: cannot import {module_name!r} ({e})") from None
        raise ObjectPathError(f"{path!r}: importing {module_name!r} failed: {_where(e)}") from None
    except SyntaxError as e:
        raise ObjectPathError(f"{path!r}: importing {module_name!r} failed: SyntaxError: {e.msg} "
                              f"({e.filename}, line {e.lineno})") from None
    except Exception as e:  # noqa: BLE001 - a user's module may raise anything while it runs
        raise ObjectPathError(f"{path!r}: importing {module_name!r} failed: {_where(e)}") from None


def _where(e: BaseException) -> str:
    """'Type: message (file, line N)' at the innermost frame of the error."""
    frames = traceback.extract_tb(e.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename] or frames
    at = f" ({user[-1].filename}, line {user[-1].lineno})" if user else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())}{at}"
