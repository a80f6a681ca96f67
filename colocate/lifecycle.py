"""Run lifecycle: graceful stop on SIGTERM/SIGINT/SIGHUP, death with the launcher, and explicit
fault injection for tests.

A first SIGTERM, SIGINT or SIGHUP (a scheduler, Ctrl-C, a closed terminal: torchrun passes each on
to the ranks) only sets `StopSignal.requested`; the role loops carry the request to every rank
inside messages they exchange anyway (the trajectory header, the adapter header), so all ranks
stop after the same step, the learner writes a checkpoint (when checkpoints are on), the adapter
and the summary, and the job exits cleanly. A second signal exits at once (the default action), so
a wedged rank can still be killed. Before `StopSignal` is installed (a rank's imports and checks)
a stop signal ends the rank at once and quietly (`quiet_start`): nothing is written yet, and
`colocate train` says the one line.

A start's imports (torch, transformers) allocate for seconds and free almost nothing, yet each full
cycle collection walks the whole heap so far: the launcher and a rank make them with the collector
off and then freeze what they built (`freeze_heap`), so that no later collection, nor a forked
child's, walks it again.

`COLOCATE_FAULT` injects failures for the failure tests; it is read once and does nothing unless
set. Forms: `raise:rank=R:step=S` (rank R raises at step S), `exit:rank=R:step=S:code=C` (rank
R leaves with `os._exit(C)` at step S, as user code may), `kill_in_checkpoint:step=S` (the
checkpoint writer SIGKILLs itself halfway through writing step S), `nan:from=S` (the learners'
advantages are NaN from step S on, so the loss is non-finite), `flip:from=S` (the learners'
advantages change sign from step S on: the policy unlearns, a reward collapse on demand).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import os
import signal
import sys
import threading
import time


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop a run gracefully (torchrun's agent forwards these to the ranks)."""


class StopSignal:
    def __init__(self):
        self.requested = False
        self.signum: int | None = None

    def install(self) -> "StopSignal":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # second signal: default action now
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.requested, self.signum = True, signum
        if signum == signal.SIGHUP:
            leave_terminal()


class TerminalGuard:
    """A rank's sys.stdout / sys.stderr on a terminal. The terminal can close while the rank runs
    (its window, an ssh session): the kernel fails every write with EIO at once, and the SIGHUP the
    launcher passes on comes after. A write that fails so sends both streams to /dev/null
    (`leave_terminal`) instead of ending the rank before its stop checkpoint."""

    def __init__(self, stream):
        self._stream = stream

    def _guarded(self, call, *args):
        import errno
        try:
            return call(*args)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            leave_terminal()
            return call(*args)  # the text still buffered goes to /dev/null now

    def write(self, text: str) -> int:
        return self._guarded(self._stream.write, text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_terminal() -> None:
    """Wrap sys.stdout and sys.stderr in `TerminalGuard` when they are a terminal."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and stream.isatty():
            setattr(sys, name, TerminalGuard(stream))


def leave_terminal() -> None:
    """After SIGHUP (the terminal closed): stdout and stderr, when they are a terminal, go to
    /dev/null. A hung-up terminal fails every write with EIO, which would end a stopping rank
    before its checkpoint, and the launcher before its exit code."""
    import stat
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            if stat.S_ISCHR(os.fstat(fd).st_mode):  # a terminal (or /dev/null already)
                os.dup2(devnull, fd)
        except OSError:  # closed: nothing to write to either way
            pass
    os.close(devnull)


def quiet_start() -> None:
    """A rank's first act: until `StopSignal` takes over, a stop signal ends it with 128 + N and no
    `KeyboardInterrupt` traceback from the middle of an import (one per rank, interleaved)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _end_quietly)


def _end_quietly(signum, frame) -> None:
    exit_quietly(128 + signum)


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "NCCL communicator was aborted", "Socket Timeout", "Timed out waiting")
"""What a rank's transport says when another rank died (gloo, NCCL, the TCP store)."""


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` only reports that another rank went away (that rank prints the cause)."""
    import torch.distributed as dist
    text = str(error)
    return isinstance(error, dist.DistError) or (isinstance(error, (RuntimeError, ConnectionError, OSError))
                                                 and any(m in text for m in PEER_GONE))


def quiet_thread_peer_failures() -> None:
    """A background thread (the trajectory sender) that fails because a peer died prints nothing;
    any other failure of a thread is printed as before."""
    default = threading.excepthook

    def hook(args) -> None:
        if args.exc_value is not None and is_peer_failure(args.exc_value):
            return
        default(args)
    threading.excepthook = hook


FAILED_EXIT = 1
"""The exit code of a rank that failed, and of `colocate train` when one did (README)."""


def _is_library(filename: str) -> bool:
    """Whether a frame's file is colocate's own, Python's or an installed package's (not the user's)."""
    import sysconfig
    here = os.path.dirname(os.path.abspath(__file__))  # colocate/, and kernels/ beside it when editable
    roots = [here, os.path.join(os.path.dirname(here), "kernels"),
             *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))]
    path = os.path.abspath(filename)
    return filename.startswith("<") or any(path.startswith(os.path.abspath(r) + os.sep) for r in roots)


def shown_path(path: str) -> str:
    """A file's path as a line shows it: relative to the working directory when inside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def failure_frame(error: BaseException):
    """The frame to name for `error`: the innermost one of the user's code (a reward function, an
    env, a tool) anywhere in its chain of causes, else the innermost one where it was raised."""
    import traceback
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for e in reversed(chain):  # the root cause first
        user = [f for f in traceback.extract_tb(e.__traceback__) if not _is_library(f.filename)]
        if user:
            return user[-1]
    frames = traceback.extract_tb(chain[0].__traceback__)
    return frames[-1] if frames else None


def report_failure(error: BaseException, rank: int, role: str, run_dir: str) -> str:
    """Write the full traceback to `<run_dir>/failure-rank<R>.txt` -> the one line to print: the
    error, the function, file and line it names, and where the traceback is."""
    import traceback
    path = os.path.join(run_dir, f"failure-rank{rank}.txt")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write("".join(traceback.format_exception(error)))
        where = f"traceback in {path}"
    except OSError as e:
        where = f"traceback not written ({path}: {e.strerror})"
    frame = failure_frame(error)
    at = f"; at {frame.name} ({shown_path(frame.filename)}:{frame.lineno})" if frame else ""
    message = str(error).splitlines()[0] if str(error) else ""
    return f"colocate: failed: rank {rank} ({role}): {type(error).__name__}: {message}{at}; {where}"


LAUNCHER_NOTES = {"failed": "this rank failed and printed why", "peer": "this rank lost a peer: another rank ended first"}
"""What a rank's torchrun error file says (torchrun's own summary shows it, under a bare torchrun)."""


def tell_launcher(kind: str) -> None:
    """This rank's torchrun error file (`TORCHELASTIC_ERROR_FILE`, read when the rank has exited):
    `kind` "failed" (the rank printed its line) or "peer" (it only saw another rank go), which
    `colocate train` reads to tell the rank that ended the job from those that followed it. A rank
    that leaves none (killed, an `os._exit`) said nothing: `colocate train` says the line."""
    from colocate.jsonfile import write_atomic
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        write_atomic(path, {"message": LAUNCHER_NOTES[kind], "timestamp": int(time.time()), "colocate": kind})
    except OSError:  # the launcher's directory is gone: it is not listening either
        pass


def exit_quietly(code: int = 1) -> None:
    """Leave now without unwinding (a process group's teardown could wait on the dead peer)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def freeze_heap() -> None:
    """Every object so far out of the cycle collector's walks (`gc.freeze`; the collector's state
    is the caller's). Cyclic garbage the imports left stays too, until an unfreeze (a rank's
    `run_rank` unfreezes at its end): a few thousand small objects, for no collection walking the
    whole imported heap again. A teardown (`sys.exit`, vLLM's exit) unfreezes it first: nanobind reports
    frozen objects as leaked, a page of lines after a rank's one line for bad input."""
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


MAIN_ATTRIBUTES = ("__spec__", "__file__")
"""What multiprocessing's `spawn` reads off `__main__` to run it again in a child."""


@contextlib.contextmanager
def spawn_without_main():
    """Processes spawned meanwhile do not run the main module again (restored afterwards).

    `spawn` runs the parent's main module again in every child, as `__mp_main__`, so that the child
    can unpickle what it defines. A rank's main module is `colocate.train`, whose imports are the
    learner's stack; vLLM's engine core and the env's copies (`envs.processes`) need none of it
    (their targets and arguments are named by their own modules), and importing it only delayed
    their start.
    """
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in MAIN_ATTRIBUTES if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        for k in MAIN_ATTRIBUTES:
            if k in saved:
                main.__dict__[k] = saved[k]
            else:
                main.__dict__.pop(k, None)


def leave(code: int) -> None:
    """A command's end, with its exit code. A process that never imported vLLM leaves without the
    interpreter's teardown: freeing a torch + transformers heap object by object took 1.3-1.9 s
    on a 2-core machine, and threads of abandoned user calls cannot hold the exit open. Everything
    it wrote is closed by then (summary, TensorBoard, trackers, checkpoints: each closes its own).
    A process that imported vLLM exits normally, so vLLM's finalizers stop its engine core."""
    if "vllm" in sys.modules:
        sys.exit(code)
    exit_quietly(code)


PR_SET_PDEATHSIG = 1


def kill_at_parent_death() -> bool:
    """Linux: the kernel sends this process SIGKILL when the thread that started it ends (`prctl`)
    -> whether it took the request (False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def die_with_parent() -> None:
    """End this rank when its launcher dies (a supervisor's kill -9 of torchrun must not leave ranks
    training on): the kernel sends SIGKILL at the parent's death (Linux `prctl`), elsewhere a
    thread polls the parent pid. A parent that died before the call is caught by the pid check."""
    parent = os.getppid()
    if kill_at_parent_death():
        if os.getppid() != parent:
            os._exit(1)
        return
    threading.Thread(target=_watch_parent, args=(parent,), name="colocate-parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    launcher_gone(parent)


def launcher_gone(parent: int) -> None:
    """This rank's launcher (pid `parent`) ended: say so and leave (nobody waits for this rank)."""
    print(f"colocate: launcher (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
    os._exit(1)


class Faults:
    """Where a run can be made to fail on purpose: before a learner step, on a batch, in the middle of
    a checkpoint write. This one does nothing, and is what a run gets; the composition root builds
    `faults_from_env()`, the only place that reads COLOCATE_FAULT (the failure tests set it)."""

    def before_step(self, rank: int, step: int) -> None:
        pass

    def on_batch(self, step: int, batch) -> None:
        pass

    def mid_checkpoint(self, step: int) -> None:
        pass


NO_FAULTS = Faults()


class InjectedFaults(Faults):
    """COLOCATE_FAULT: `raise:rank=R:step=S` (a rank raises before step S), `exit:rank=R:step=S:code=C`
    (a rank leaves with `os._exit(C)` before step S, no word said), `kill_in_checkpoint:step=S`
    (SIGKILL in the middle of step S's checkpoint write), `nan:from=S` (NaN advantages from step S on:
    the non-finite-loss path), `flip:from=S` (negated advantages from step S on: a reward collapse)."""

    def __init__(self, spec: str):
        kind, *fields = spec.split(":")
        self.kind = kind
        self.fields = {key: int(value) for key, _, value in (f.partition("=") for f in fields)}

    def before_step(self, rank: int, step: int) -> None:
        if self.fields.get("rank") != rank or self.fields.get("step") != step:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault (COLOCATE_FAULT) at step {step}")
        if self.kind == "exit":
            os._exit(self.fields.get("code", 1))

    def on_batch(self, step: int, batch) -> None:
        if self.kind == "nan" and step >= self.fields.get("from", 0):
            batch.advantages.fill_(float("nan"))
        if self.kind == "flip" and step >= self.fields.get("from", 0):
            batch.advantages.neg_()

    def mid_checkpoint(self, step: int) -> None:
        if self.kind == "kill_in_checkpoint" and self.fields.get("step") == step:
            os.kill(os.getpid(), signal.SIGKILL)


def faults_from_env() -> Faults:
    spec = os.environ.get("COLOCATE_FAULT", "")
    return InjectedFaults(spec) if spec else NO_FAULTS


