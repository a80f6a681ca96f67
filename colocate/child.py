"""Work that calls the user's code, run by the launcher in a forked child (`run_in_child`).

`colocate train` and `colocate check` check a config by importing and calling the user's code (a
reward module, an env class, tools). That code must not end, break or move the launcher: a reward
that calls `os._exit(0)` would make `colocate train` exit 0 with no word, one that patches `json` at
import would break torchrun's launch, one that calls `os.chdir` would move the launcher and the
ranks it starts. So the work runs in a child forked from the launcher (a fork: the modules the
launcher imported are there without a second import, and the parsed config travels as it is), and
only its text result comes back. Whatever the child prints reaches the launcher's own `sys.stdout`
and `sys.stderr` as it is written (through the pipe, so a caller that captures them sees it too),
and an end without a result (exit, signal) is the caller's to report.

Standard library only; nothing of colocate.
"""
from __future__ import annotations

import io
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Callable

OUT, ERR, RESULT, END = b"o", b"e", b"r", b"x"
"""What a block on the pipe holds: the child's stdout, its stderr, its result, or its own end (the
work returned or raised; without it, something else ended the child)."""
HEADER = 9
"""A block's header: its kind (one byte) and its length (8 bytes, big-endian)."""


def _send(fd: int, kind: bytes, data: bytes) -> None:
    block = kind + len(data).to_bytes(8, "big") + data
    while block:
        block = block[os.write(fd, block):]


class _PipeText(io.TextIOBase):
    """The child's stdout or stderr: each write goes to the launcher at once (a user's call that
    ends the process later loses nothing already printed)."""

    def __init__(self, fd: int, kind: bytes, lock: threading.Lock):
        self._fd, self._kind, self._lock = fd, kind, lock

    @property
    def encoding(self) -> str:
        return "utf-8"

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        """The launcher's own stdout or stderr, for what writes below Python (faulthandler)."""
        return 1 if self._kind == OUT else 2

    def write(self, text: str) -> int:
        with self._lock:  # reward checks print from their worker threads too
            _send(self._fd, self._kind, text.encode("utf-8", "replace"))
        return len(text)


def _child(work: Callable[[], str], refusal: Callable[[BaseException], tuple[int, str]], fd: int) -> None:
    """The forked child: `work()`, its result sent; a raise is `refusal`'s (exit code, line)."""
    lock = threading.Lock()
    sys.stdout, sys.stderr = _PipeText(fd, OUT, lock), _PipeText(fd, ERR, lock)
    code = 1
    try:
        _send(fd, RESULT, work().encode())
        code = 0
    except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
        code, line = refusal(e)
        if line:
            print(line, file=sys.stderr)
    finally:  # whatever happened, the child never returns into the launcher's code
        try:
            _send(fd, END, b"")
        finally:
            os._exit(code)


def _read(fd: int, size: int) -> bytes:
    """`size` bytes from `fd`, fewer only at its end."""
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            break
        data += chunk
    return data


@dataclass(frozen=True)
class Ended:
    """How the child ended."""
    code: int
    """Its exit status; -N when signal N ended it (`os.waitstatus_to_exitcode`)."""
    result: str | None = None
    """What the work returned (None: it raised, or did not return)."""
    own_end: bool = False
    """The work returned or raised (False: something in it - the user's code - ended the child)."""


def _relay(fd: int) -> Ended:
    """Pass the child's output on until the pipe closes -> its result and whether it ended itself."""
    result, own_end = None, False
    while len(header := _read(fd, HEADER)) == HEADER:
        data = _read(fd, int.from_bytes(header[1:], "big"))
        kind = header[:1]
        if kind == RESULT:
            result = data.decode()
        elif kind == END:  # not the pipe's end: a process the user's code forked may hold it open
            own_end = True
            break
        else:
            stream = sys.stdout if kind == OUT else sys.stderr
            stream.write(data.decode("utf-8", "replace"))
            stream.flush()
    return Ended(0, result, own_end)


@dataclass(frozen=True)
class Child:
    """A forked child at work (`start_child`): its pid, and the pipe its output and result come on."""
    pid: int
    fd: int


def start_child(work: Callable[[], str], refusal: Callable[[BaseException], tuple[int, str]]) -> Child:
    """Fork a child that runs `work()` -> the child; `finish_child` relays its output and waits for
    it. A raise in the child is `refusal(error)` -> (exit code, line to print there). Fork before
    this process starts threads (a fork copies only the calling thread; a lock another thread holds
    stays held in the child)."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            _child(work, refusal, write_fd)
        finally:
            os._exit(1)
    os.close(write_fd)
    return Child(pid, read_fd)


def finish_child(child: Child) -> Ended:
    """Pass the child's output on to this process's streams until it ends -> how it ended (run on
    any thread; `kill_child` from another ends it sooner)."""
    try:
        ended = _relay(child.fd)
    except BaseException:  # Ctrl-C while the checks run: the child goes with the launcher
        kill_child(child)
        os.waitpid(child.pid, 0)
        raise
    finally:
        os.close(child.fd)
    return Ended(os.waitstatus_to_exitcode(os.waitpid(child.pid, 0)[1]), ended.result, ended.own_end)


def kill_child(child: Child) -> None:
    """End the child now (SIGKILL); one that has ended already is left as it is."""
    try:
        os.kill(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_in_child(work: Callable[[], str], refusal: Callable[[BaseException], tuple[int, str]]) -> Ended:
    """`work()` in a forked child, its output relayed here -> how it ended (`start_child`, then
    `finish_child`)."""
    return finish_child(start_child(work, refusal))
