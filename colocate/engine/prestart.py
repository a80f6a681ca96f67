"""Where vLLM's engine core process starts: the environment it gets, and (`engine.prestart`) a
forkserver started early on the inference rank that it forks from with vLLM already imported.

A process that imports vLLM spends seconds in the imports (torch, Dynamo, vLLM) before its first
line. vLLM spawns its engine core from our rank (CUDA is initialised there, so it must not fork
it), and on a cold `VLLM_CACHE_ROOT` it inspects the model class in one more fresh interpreter
first (`vllm.model_executor.models.registry._run_in_subprocess`). Instead, the rank starts one
multiprocessing forkserver as its first act (`start_engine_server`, from `headstart.head_start` in
`train.py`'s `__main__`, before the rank imports torch), which imports `VLLM_PRELOAD` while the rank
makes its own imports, waits for the launcher and builds its model; CUDA is never initialised in it.
This module imports nothing heavy for that reason. While `vllm.LLM` is built
(`engine_core_start`), vLLM's engine core and its model inspection are children of that server:
forked, not spawned, their imports done. vLLM's own API server does the same
(`VLLM_WORKER_MULTIPROC_METHOD=forkserver`); our rank cannot ask for it that way, since vLLM
forces spawn once CUDA is initialised.

A child of the server (`ServerChild`) behaves as a spawned one: it runs with the environment its
parent had at `start()` (a forked child would keep the server's, fixed when it started, before the
compile caches or vLLM's own settings were set), the parent's `sys.path` and working directory
(multiprocessing's preparation data), never the parent's main module, the stop signals delivered
(the server itself has them blocked: a stop is the rank's to handle, and the server ends with its
last client). The modules the server imported read the environment it was started with
(`engine_environment`: the rank's GPU, no torchrun variables).

Whatever keeps the server from serving (it did not start, a preloaded module initialised CUDA, it
was started for another GPU, vLLM lacks the names patched) is one `colocate:` line, and vLLM
spawns its engine core as it does without the server.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import forkserver, resource_tracker
from multiprocessing.context import ForkServerContext, ForkServerProcess

from colocate.lifecycle import STOP_SIGNALS, spawn_without_main
from colocate.startup import mark

TORCHRUN_VARIABLES = ("TORCHELASTIC_USE_AGENT_STORE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VLLM_PRELOAD = ("vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker",
                "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner",
                "vllm.model_executor.models.qwen2", "vllm.plugins",
                "colocate.engine.prestart", "colocate.engine.vllm_worker", "colocate.engine.vllm_trie")
"""What the engine core imports (vLLM 0.25, TP=1): its process's module, the one-process executor,
the GPU worker, both model runners (V2 is vLLM's default for dense models, V1 its fallback), the
Qwen2 model (the embedded shapes; another architecture's module is imported by the engine core),
and our worker extension. None of them is meant to initialise CUDA at import (read in vLLM 0.25's
sources; the server's first child checks it); one that fails to import is left to the engine core
(Python's forkserver skips it; the line names it)."""


# ---------------------------------------------------------------------------------- environment

def visible_device(gpu: int) -> str:
    """The physical GPU of this process's CUDA index `gpu`, honouring a CUDA_VISIBLE_DEVICES already set."""
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    return current.split(",")[gpu] if current else str(gpu)


@contextlib.contextmanager
def engine_environment(gpu: int | None):
    """The environment the engine core is started with (restored afterwards).

    Without torchrun's variables the child's own process group cannot join torchrun's agent store
    (it hung there); CUDA_VISIBLE_DEVICES gives it this rank's GPU as cuda:0.
    VLLM_WORKER_MULTIPROC_METHOD=spawn is what vLLM forces anyway from a rank where CUDA is
    initialised; said up front, vLLM does not warn that it overrides the method, which read as if the
    engine core were spawned where the server forks it (engine.prestart).
    """
    keys = TORCHRUN_VARIABLES + ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "NCCL_CUMEM_ENABLE",
                                 "VLLM_WORKER_MULTIPROC_METHOD")
    saved = {k: os.environ.get(k) for k in keys}
    try:
        if gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_device(gpu)
        for k in TORCHRUN_VARIABLES:
            os.environ.pop(k, None)
        os.environ["PYTHONPATH"] = REPO_ROOT + (os.pathsep + saved["PYTHONPATH"] if saved["PYTHONPATH"] else "")
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # as the learner's side; mixed settings hang
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------------- the server

class ServerChild(ForkServerProcess):
    """A process forked by the server that starts as a spawned one would (module docstring)."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        with spawn_without_main():
            super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        super().run()


class EngineCoreChild(ServerChild):
    """vLLM's engine core: its start is a start-up mark (its imports are done, its init begins)."""

    def start(self) -> None:
        super().start()
        mark("engine_core_started")


class EngineCoreContext(ForkServerContext):
    """What vLLM's engine-core launcher gets for `get_mp_context()` while the server serves."""
    Process = EngineCoreChild


@dataclass
class Server:
    """The server this process started."""
    preload: tuple[str, ...]
    devices: str | None
    """CUDA_VISIBLE_DEVICES it was started with (what its imports saw)."""
    started: float = field(default_factory=time.time)
    error: str = ""
    """Why it did not start ("" when it did)."""
    context: EngineCoreContext | None = None
    checked: bool = False
    """Whether `usable_server` has looked at it (once per process)."""


_SERVER: Server | None = None
"""Python's forkserver is one per process, and so is this record of it."""


PRELOAD_MODULE = "colocate.engine.prestart_preload"
"""The server's one preload: it ends with this process, then imports the modules it is given, each
failure kept by name (`prestart_preload`)."""
PRELOAD_ENV, PARENT_ENV = "COLOCATE_PRESTART_PRELOAD", "COLOCATE_PRESTART_PARENT"
"""Set in the environment the server starts with, for its preload: the modules to import
(comma-separated) and this process's pid."""


def start_server(preload: tuple[str, ...]) -> Server:
    """Start the forkserver in this process's environment, importing `preload` (never `__main__`;
    through `PRELOAD_MODULE`), with the stop signals blocked in it (blocked here for the moment of
    its start, not lost)."""
    global _SERVER
    server = Server(tuple(preload), os.environ.get("CUDA_VISIBLE_DEVICES"))
    old = None
    try:
        resource_tracker.ensure_running()  # its own start, as with spawn: outside the signals' block
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        os.environ[PRELOAD_ENV] = ",".join(preload)  # read by the server's one preload, at its start
        os.environ[PARENT_ENV] = str(os.getpid())
        forkserver.set_forkserver_preload([PRELOAD_MODULE])
        forkserver.ensure_running()
    except (OSError, ValueError) as e:
        server.error = f"{type(e).__name__}: {e}"
    finally:
        for key in (PRELOAD_ENV, PARENT_ENV):
            os.environ.pop(key, None)
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    _SERVER = server
    return server


def start_engine_server(gpu: int) -> Server:
    """The inference rank's head start (`headstart.SERVERS`): the server for GPU `gpu`, in the engine
    core's environment. On the rank's main thread, before any other thread reads the environment
    this sets for a moment (the launcher's watch reads none)."""
    with engine_environment(gpu):
        server = start_server(VLLM_PRELOAD)
    mark("engine_prestart")
    return server


CHILD_TIMEOUT_S = 300
"""How long a child of the server may take to answer (the first one waits for the server's imports,
seconds): past it the child is killed and its call fails (the engine core then spawns)."""


def call_in_child(target, *args):
    """target(*args) in a child of the server -> its result. An exception there, or a child that
    ends without an answer, is one RuntimeError here naming it (as vLLM's `_run_in_subprocess`)."""
    answer, child_end = multiprocessing.Pipe(duplex=False)
    child = ServerChild(target=_answer, args=(child_end, target, args), name=f"colocate-{target.__name__}")
    try:
        child.start()
    except (OSError, EOFError) as e:  # the server is gone
        raise RuntimeError(f"Error raised in subprocess:\nthe forkserver did not start a child "
                           f"({type(e).__name__}: {e})") from e
    finally:
        child_end.close()
    try:
        kind, value = answer.recv() if answer.poll(CHILD_TIMEOUT_S) else ("error", f"no answer in {CHILD_TIMEOUT_S} s")
    except EOFError:
        kind, value = "error", None
    finally:
        answer.close()
        if child.exitcode is None and kind == "error":
            child.kill()  # a server whose imports hang: the build goes on without it
        child.join()
    if kind == "ok":
        return value
    raise RuntimeError("Error raised in subprocess:\n" + (value or f"{target.__name__} ended with exit code "
                                                         f"{child.exitcode} and no answer"))


def _answer(conn, target, args) -> None:
    """The child's side of `call_in_child`."""
    try:
        conn.send(("ok", target(*args)))
    except Exception:  # noqa: BLE001 - carried to the parent as text: it raises it there
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def server_state(preload: tuple[str, ...]) -> dict:
    """In a child of the server: the preloaded modules it lacks, whether torch had initialised CUDA in
    the server (a forked child then cannot use it) and the server's threads (fork copies only one)."""
    cuda, failed = sys.modules.get("torch.cuda"), getattr(sys.modules.get(PRELOAD_MODULE), "FAILED", {})
    return {"missing": [f"{m} ({failed[m]})" if m in failed else m for m in preload if m not in sys.modules],
            "cuda": bool(cuda is not None and cuda._is_in_bad_fork()),
            "threads": len(os.listdir(f"/proc/{os.getppid()}/task")) if os.path.isdir("/proc") else 0}


def unusable(server: Server, state: dict | None) -> str:
    """Why the engine core must not fork from `server` ("" when it may), given its first child's
    `server_state` (None: not asked yet)."""
    if server.error:
        return f"it did not start ({server.error})"
    if server.devices != os.environ.get("CUDA_VISIBLE_DEVICES"):
        return (f"it was started with CUDA_VISIBLE_DEVICES={server.devices}, the engine core gets "
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')}")
    if state is not None and state["cuda"]:
        return "a module it imported initialised CUDA, which a forked child cannot use"
    return ""


def usable_server(preload: tuple[str, ...] = VLLM_PRELOAD) -> EngineCoreContext | None:
    """Inside `engine_environment`, as vLLM builds the engine: the context of the server to start the
    engine core from (started now when the rank did not start it early), else None after one line.
    Its first child waits for the server's imports; the line says how long."""
    server = _SERVER or start_server(preload)
    reason = unusable(server, None)  # every engine: another one in this process may want another GPU
    if server.checked and not reason:
        return server.context
    server.checked = True
    state, t0 = None, time.time()
    if not reason:
        try:
            state = call_in_child(server_state, server.preload)
        except RuntimeError as e:
            reason = f"its first child failed: {str(e).splitlines()[-1]}"
        reason = reason or unusable(server, state)
    if reason:
        print(f"colocate: engine.prestart: the engine core's forkserver is not used: {reason}; vLLM spawns "
              "the engine core", flush=True)
        return None
    missing = f"; not preloaded: {', '.join(state['missing'])}" if state["missing"] else ""
    print(f"colocate: engine.prestart: vLLM's engine core forks from the server started {t0 - server.started:.1f} s "
          f"before the engine (which waited {time.time() - t0:.1f} s for its imports; server threads: "
          f"{state['threads']}{missing})", flush=True)
    server.context = EngineCoreContext()
    return server.context


# ---------------------------------------------------------------------------------- vLLM

VLLM_NAMES = (("vllm.v1.engine.utils", "get_mp_context"), ("vllm.model_executor.models.registry", "_run_in_subprocess"))
"""What `engine_core_start` swaps (vLLM 0.25's private names): the context the engine-core launcher
starts its process with, and how the model registry inspects a model class in a fresh process."""


def vllm_modules() -> tuple[list, str]:
    """The modules of `VLLM_NAMES`, imported -> (modules, "") or ([], the one that is missing)."""
    import importlib
    modules = []
    for module_name, name in VLLM_NAMES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        if not hasattr(module, name):
            return [], f"{module_name}.{name}"
        modules.append(module)
    return modules, ""


def inspect_in_server(fn):
    """vLLM's `_run_in_subprocess`: `fn` (a closure: cloudpickled, as vLLM sends it) in a child of
    the server instead of a fresh interpreter; an error there is one RuntimeError, as vLLM's."""
    import cloudpickle
    return call_in_child(call_pickled, cloudpickle.dumps(fn))


def call_pickled(payload: bytes):
    """In the child: vLLM's general plugins loaded (its subprocess does that first), then the function."""
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    return pickle.loads(payload)()


@contextlib.contextmanager
def swapped(changes: list[tuple[object, str, object]]):
    """Each (module, name, value) set for the duration, the old values restored after."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in changes]
    try:
        for module, name, value in changes:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def engine_core_start(prestart: bool):
    """The context `vllm.LLM` is built in (inside `engine_environment` and `spawn_without_main`):
    with `prestart`, vLLM's engine core and its model inspection come from the server; otherwise,
    or when it cannot serve (one line), vLLM's own spawn."""
    if not prestart:
        return contextlib.nullcontext()
    modules, missing = vllm_modules()
    if missing:
        print(f"colocate: engine.prestart: this vLLM has no {missing}; vLLM spawns the engine core", flush=True)
        return contextlib.nullcontext()
    context = usable_server()
    if context is None:
        return contextlib.nullcontext()
    utils, registry = modules
    vllm_context = utils.get_mp_context

    def get_mp_context():
        vllm_context()  # vLLM's own checks and settings (spawn for what the engine core starts itself)
        return context
    return swapped([(utils, "get_mp_context", get_mp_context), (registry, "_run_in_subprocess", inspect_in_server)])
