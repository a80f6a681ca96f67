"""The engine core's pre-started forkserver (`colocate/engine/prestart.py`) without vLLM: a real
server preloading a tiny module, its children (what they find imported, the environment they run
with, the parent's main module left alone), `call_in_child` and the model-inspection stand-in with
their errors, the swap of vLLM's names around a construction against stand-in modules, and the
fallbacks. One server serves most tests (its preload imports colocate's prestart module, no torch:
the rank's head start needs none); another dies in its imports at once."""
import os
import signal
import sys
import time
import types
from multiprocessing import forkserver

import pytest

from colocate.engine import prestart
from colocate.engine.prestart import (EngineCoreContext, Server, call_in_child, engine_core_start,
                                      engine_environment, inspect_in_server, unusable, usable_server)
from colocate.lifecycle import STOP_SIGNALS

PROBE = """import os, signal, sys
IMPORTED_IN = os.getpid()
SEEN_AT_IMPORT = os.environ.get("COLOCATE_PRESTART_TEST")
{extra}

def report():
    return {{"imported_in": sys.modules[__name__].IMPORTED_IN, "pid": os.getpid(),
             "seen_at_import": SEEN_AT_IMPORT, "seen": os.environ.get("COLOCATE_PRESTART_TEST"),
             "cwd": os.getcwd(), "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}}

def fail():
    raise ValueError("bad row 7")

def leave():
    os._exit(3)
"""
"""A module the test server preloads: it records where it was imported and what it saw then."""


def start_probe_server(folder, extra: str = "") -> Server:
    """A real forkserver preloading `colocate_prestart_probe` (with `extra` lines) from `folder`,
    started with COLOCATE_PRESTART_TEST=server (the environment is restored after its start)."""
    (folder / "colocate_prestart_probe.py").write_text(PROBE.format(extra=extra))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(folder))
        mp.setenv("COLOCATE_PRESTART_TEST", "server")
        with engine_environment(None):  # the repository first on the server's path, as for the engine core
            return prestart.start_server(("colocate_prestart_probe", "colocate.engine.prestart"))


@pytest.fixture
def dying_server(tmp_path, monkeypatch):
    """A server whose preloaded module raises (first in this file: Python's forkserver is one per process)."""
    monkeypatch.setattr(prestart, "_SERVER", None)
    yield start_probe_server(tmp_path, extra="raise RuntimeError('no driver')")
    forkserver._forkserver._stop()


@pytest.fixture(scope="module")
def probe_server(tmp_path_factory):
    """One server for the tests below."""
    folder = tmp_path_factory.mktemp("probe")
    server = start_probe_server(folder)
    yield server, folder
    forkserver._forkserver._stop()


@pytest.fixture
def server(probe_server, monkeypatch):
    """The module's server, not yet looked at by `usable_server`; its probe module importable here."""
    server, folder = probe_server
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(prestart, "_SERVER", Server(server.preload, server.devices, server.started))
    return prestart._SERVER


def test_a_preload_that_raises_is_named_in_the_line_and_the_server_still_serves(dying_server, capsys):
    """A preloaded module that raises something else than ImportError would end Python's forkserver
    with a traceback (it skips only ImportError): the server's one preload keeps the failure by name
    instead, the server serves, and the rank's one line names the module and why."""
    assert usable_server() is not None
    line = capsys.readouterr().out
    assert "forks from the server" in line
    assert "not preloaded: colocate_prestart_probe (RuntimeError: no driver)" in line
    assert "Traceback" not in line


def test_a_child_finds_the_preload_imported_and_runs_as_a_spawned_one(server, monkeypatch, tmp_path):
    """The preloaded module was imported once, in the server, under the server's environment; the
    child runs with the environment its parent has at `start()` and in its working directory, and
    the parent's main module (a rank's `colocate.train`) is not run again, and it gets the stop
    signals the server has blocked."""
    import importlib
    server_pid = forkserver._forkserver._forkserver_pid
    marker = tmp_path / "main ran"
    (tmp_path / "colocate_prestart_main.py").write_text(f"open({str(marker)!r}, 'a').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "__main__", importlib.import_module("colocate_prestart_main"))
    marker.unlink()
    monkeypatch.setenv("COLOCATE_PRESTART_TEST", "at start")
    monkeypatch.chdir(tmp_path)
    probe = importlib.import_module("colocate_prestart_probe")
    got = call_in_child(probe.report)
    assert got["imported_in"] == server_pid != got["pid"] and got["seen_at_import"] == "server"
    assert got["seen"] == "at start" and got["cwd"] == str(tmp_path)
    assert not marker.exists()
    # the stop signals: blocked in the server (the rank handles a stop), delivered to its children
    assert got["blocked"] == [] and signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()
    with open(f"/proc/{server_pid}/status") as f:
        blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
    assert all(blocked >> (s - 1) & 1 for s in STOP_SIGNALS)


def test_a_childs_error_is_one_runtime_error_naming_it(server):
    import importlib
    probe = importlib.import_module("colocate_prestart_probe")
    with pytest.raises(RuntimeError, match=r"(?s)^Error raised in subprocess:.*ValueError: bad row 7") as e:
        call_in_child(probe.fail)
    assert "Traceback" in str(e.value)  # the child's traceback, as vLLM's message carries its stderr
    with pytest.raises(RuntimeError, match="leave ended with exit code 3 and no answer"):
        call_in_child(probe.leave)


def test_the_model_inspection_runs_its_closure_in_a_child_with_vllms_plugins(server, tmp_path, monkeypatch):
    """vLLM's `_run_in_subprocess` stand-in: the closure (cloudpickled) runs in a child that loaded
    vLLM's general plugins first, its result comes back, its exception is one RuntimeError."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "plugins.py").write_text("LOADED = []\ndef load_general_plugins():\n    LOADED.append(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the child takes this process's path
    base = 40
    assert inspect_in_server(lambda: (sys.modules["vllm.plugins"].LOADED, base + 2)) == ([1], 42)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        inspect_in_server(lambda: base / 0)


def test_the_engine_forks_from_a_started_server_once_checked(server, capsys):
    context = usable_server()
    assert isinstance(context, EngineCoreContext) and usable_server() is context  # looked at once
    line = capsys.readouterr().out
    assert line.startswith("colocate: engine.prestart: vLLM's engine core forks from the server started")
    assert "not preloaded" not in line


def test_a_server_that_did_not_start_leaves_the_engine_to_vllms_spawn(monkeypatch, capsys):
    def refuse():
        raise OSError("no room for the server")
    monkeypatch.setattr(prestart, "_SERVER", None)
    monkeypatch.setattr(forkserver, "ensure_running", refuse)
    assert usable_server(("colocate.engine.prestart",)) is None
    assert capsys.readouterr().out == ("colocate: engine.prestart: the engine core's forkserver is not used: it did "
                                       "not start (OSError: no room for the server); vLLM spawns the engine core\n")


def test_why_a_started_server_cannot_serve(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert unusable(Server(("m",), "2"), {"cuda": False}) == ""
    assert "started with CUDA_VISIBLE_DEVICES=1, the engine core gets 2" in unusable(Server(("m",), "1"), None)
    assert "initialised CUDA" in unusable(Server(("m",), "2"), {"cuda": True})


def stand_in_vllm(monkeypatch, registry_has_it: bool = True) -> tuple[types.ModuleType, types.ModuleType, list]:
    """vLLM's two modules whose names the engine's start swaps, in sys.modules -> (utils, registry,
    the calls of vLLM's own `get_mp_context`)."""
    calls = []
    utils = types.ModuleType("vllm.v1.engine.utils")
    utils.get_mp_context = lambda: calls.append("vllm's") or "spawn context"
    registry = types.ModuleType("vllm.model_executor.models.registry")
    if registry_has_it:
        registry._run_in_subprocess = "vllm's subprocess"
    for name in ("vllm", "vllm.v1", "vllm.v1.engine", "vllm.model_executor", "vllm.model_executor.models"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    monkeypatch.setitem(sys.modules, registry.__name__, registry)
    return utils, registry, calls


def test_vllms_names_are_swapped_around_a_construction_and_restored(monkeypatch):
    """Inside: vLLM's launcher gets the server's context (after vLLM's own checks ran) and the
    registry inspects in the server; after, also after a failed construction, vLLM's own again.
    engine.prestart=false swaps nothing and starts no server."""
    utils, registry, calls = stand_in_vllm(monkeypatch)
    context = EngineCoreContext()
    monkeypatch.setattr(prestart, "usable_server", lambda: context)

    def construct():  # what `vllm.LLM(...)` reaches
        return utils.get_mp_context(), registry._run_in_subprocess
    with engine_core_start(True):
        assert construct() == (context, inspect_in_server) and calls == ["vllm's"]
    assert construct() == ("spawn context", "vllm's subprocess")
    with pytest.raises(ValueError), engine_core_start(True):
        raise ValueError("vLLM failed to start")
    assert construct() == ("spawn context", "vllm's subprocess")
    monkeypatch.setattr(prestart, "usable_server", lambda: pytest.fail("engine.prestart=false starts no server"))
    with engine_core_start(False):
        assert construct() == ("spawn context", "vllm's subprocess")


def test_a_vllm_without_the_names_keeps_its_own_spawn(monkeypatch, capsys):
    utils, registry, _ = stand_in_vllm(monkeypatch, registry_has_it=False)
    monkeypatch.setattr(prestart, "usable_server", lambda: pytest.fail("no server without vLLM's names"))
    with engine_core_start(True):
        assert utils.get_mp_context() == "spawn context"
    assert capsys.readouterr().out == ("colocate: engine.prestart: this vLLM has no vllm.model_executor.models."
                                       "registry._run_in_subprocess; vLLM spawns the engine core\n")


def test_a_child_that_never_answers_is_killed_and_its_call_fails(server, monkeypatch):
    """A server whose imports hang must not hang the engine's build: past the limit the child is
    killed and the call fails as any failed child's (the engine core then spawns)."""
    monkeypatch.setattr(prestart, "CHILD_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match="no answer in 0.5 s"):
        prestart.call_in_child(time.sleep, 30)


def test_the_server_ends_with_the_process_that_started_it_even_mid_import(tmp_path):
    """A refused launch ends the rank while its server still imports vLLM (seconds; the stop signals
    blocked there): the server is killed with the rank, not left importing on."""
    import subprocess
    (tmp_path / "slow_probe.py").write_text("import time\ntime.sleep(60)\n")
    script = ("import os, sys\nfrom multiprocessing import forkserver\nfrom colocate.engine import prestart\n"
              "prestart.start_server(('slow_probe',))\nprint(forkserver._forkserver._forkserver_pid, flush=True)\n"
              "os._exit(0)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), prestart.REPO_ROOT])}
    pid = int(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             timeout=60, check=True).stdout.split()[0])
    deadline = time.time() + 20
    while time.time() < deadline and alive(pid):
        time.sleep(0.1)
    assert not alive(pid)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_an_engine_for_another_gpu_does_not_fork_from_a_server_already_in_use(server, monkeypatch, capsys):
    """The server was started for one GPU; a later engine in the same process for another one (the
    suite builds several) gets vLLM's spawn and the line, not the context the first engine got."""
    assert usable_server() is not None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    assert usable_server() is None
    assert "the engine core gets 7; vLLM spawns the engine core" in capsys.readouterr().out.splitlines()[-1]
