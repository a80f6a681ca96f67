"""The one module the engine core's forkserver preloads (`engine/prestart.py`): the server first
ends with the rank that started it (a refused or failed launch must not leave it importing on, deaf
to the stop signals it blocks), then imports the modules `PRELOAD_ENV` names, each failure kept by
name in `FAILED` for the server's first child to report in the rank's one line. Python's forkserver
skips only an ImportError among its preloads; anything else would end the server with a traceback
and leave multiprocessing to start another one, silently, at the first child."""
import importlib
import os
import sys

from colocate.engine.prestart import PARENT_ENV, PRELOAD_ENV
from colocate.lifecycle import kill_at_parent_death

FAILED: dict[str, str] = {}
"""Module -> why it did not import, in the server (its children inherit it)."""


def die_with_parent() -> None:
    """SIGKILL at the starting thread's end (`lifecycle.kill_at_parent_death`), and an end now if it
    ended already (while this package's imports ran; its pid is `PARENT_ENV`); elsewhere the server
    ends with its last client, after its imports."""
    if sys.platform.startswith("linux"):
        try:
            kill_at_parent_death()
        except (OSError, AttributeError):
            return
        if str(os.getppid()) != os.environ.get(PARENT_ENV, str(os.getppid())):
            os._exit(0)


die_with_parent()
for name in [name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name]:
    try:
        importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - reported by the server's first child, not here
        FAILED[name] = f"{type(e).__name__}: {e}"[:200]
