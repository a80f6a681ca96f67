"""Calls of code the run did not write (tools, reward functions) in a box: a fixed pool of worker
threads, a deadline per call, and every outcome classified - a value, an `Exception` (`raised`), a
`BaseException` such as `SystemExit` (`base_exception`: user code does not get to end the run), or
no answer by the deadline (`timeout`). Nothing raises into the caller and nothing is printed.

A thread cannot be killed. A call past its deadline is answered `timeout` at once; its worker is
abandoned (it exits when the call returns; its late result is dropped) and a new worker takes its
place, so the pool keeps `workers` threads that can take calls - as long as its threads, abandoned
ones included, stay within `workers + MAX_ABANDONED`. Past that a hung call's worker is not
replaced, the pool runs short, and a call that waits for a worker past its deadline times out
unrun; an abandoned worker whose call returns exits and makes room again. So any number of calls of
a function that never returns leave at most `workers + MAX_ABANDONED` threads. Workers start when
calls need them (a pool that is never used holds no thread).

The deadline runs from submission: a call queued behind hung ones times out too.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

MAX_ABANDONED = 8
"""Threads a pool may hold beyond `workers` for abandoned (hung) ones; past it none is replaced."""


@dataclass
class Outcome:
    """How one call ended."""
    kind: str
    """value, raised, base_exception or timeout."""
    value: object = None
    error: BaseException | None = None
    ran: bool = True
    """False for a timeout that never got a worker (every worker was hung)."""

    def describe(self) -> str:
        """The exception as `Type: message` (empty for a value or a timeout)."""
        if self.error is None:
            return ""
        try:
            text = str(self.error)
        except Exception:  # noqa: BLE001 - a user's exception whose __str__ fails
            text = "<unprintable>"
        return f"{type(self.error).__name__}: {text}" if text else type(self.error).__name__


def run_boxed(fn, args: tuple = (), kwargs: dict | None = None) -> Outcome:
    """`fn(*args, **kwargs)` in this thread -> its Outcome; never raises."""
    try:
        return Outcome("value", value=fn(*args, **(kwargs or {})))
    except Exception as e:  # noqa: BLE001 - the user's failure is an outcome
        return Outcome("raised", error=e)
    except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, GeneratorExit from user code
        return Outcome("base_exception", error=e)


class Worker:
    def __init__(self):
        self.abandoned = False


class Call:
    """One call in a `CallPool`: `outcome(now)` polls it, `wait()` blocks until it ends."""

    def __init__(self, pool: "CallPool", fn, args: tuple, kwargs: dict, timeout_s: float):
        self.pool, self.fn, self.args, self.kwargs = pool, fn, args, kwargs
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s
        self.future: Future = Future()  # its Outcome, set once (by the worker or at the deadline)
        self.state = "queued"            # queued, running, done, expired (guarded by the pool's lock)
        self.worker: Worker | None = None

    def outcome(self, now: float | None = None) -> Outcome | None:
        """The outcome once the call ended, a timeout once past the deadline, else None."""
        if not self.future.done() and (time.monotonic() if now is None else now) >= self.deadline:
            self.pool.expire(self)
        return self.future.result() if self.future.done() else None

    def wait(self) -> Outcome:
        wait_first([self])
        return self.outcome()


def wait_first(calls: list[Call]) -> None:
    """Block until one of `calls` ends or the earliest deadline has passed."""
    if not calls:
        return
    deadline = min(c.deadline for c in calls)
    while (left := deadline - time.monotonic()) > 0:  # a timed wait may wake a hair early
        if wait([c.future for c in calls], timeout=left, return_when=FIRST_COMPLETED).done:
            return


class CallPool:
    """`workers` daemon threads running boxed calls with deadlines (see the module's docstring)."""

    def __init__(self, workers: int, name: str):
        self.workers, self.name = max(1, workers), name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0        # workers that take calls
        self._idle = 0        # of them, waiting for one
        self._queued = 0      # calls in the queue
        self.hung = 0         # abandoned workers still alive
        self.abandoned = 0    # workers abandoned since the last take_abandoned()
        self._closed = False

    def submit(self, fn, timeout_s: float, *args, **kwargs) -> Call:
        call = Call(self, fn, args, kwargs, timeout_s)
        with self._lock:
            self._queued += 1
            self._queue.put(call)
            self._fill()
        return call

    def run(self, fn, timeout_s: float, *args, **kwargs) -> Outcome:
        """Submit and wait: the outcome within `timeout_s`."""
        return self.submit(fn, timeout_s, *args, **kwargs).wait()

    def expire(self, call: Call) -> None:
        """Answer a call past its deadline with a timeout; abandon its worker if it is running."""
        with self._lock:
            if call.state in ("done", "expired"):
                return
            running, call.state = call.state == "running", "expired"
            call.future.set_result(Outcome("timeout", ran=running))
            if running and not call.worker.abandoned:
                call.worker.abandoned = True
                self._live -= 1
                self.hung += 1
                self.abandoned += 1
                self._fill()

    def take_abandoned(self) -> int:
        """Workers abandoned in hung calls since the last call."""
        with self._lock:
            n, self.abandoned = self.abandoned, 0
        return n

    def close(self) -> None:
        """Let the idle and running workers exit (hung ones exit when their call returns)."""
        with self._lock:
            self._closed = True
            for _ in range(self._live):
                self._queue.put(None)

    def _fill(self) -> None:
        """Start workers for the calls no idle worker will take (lock held)."""
        while (not self._closed and self._queued > self._idle and self._live < self.workers
               and self._live + self.hung < self.workers + MAX_ABANDONED):
            self._live += 1
            self._idle += 1
            threading.Thread(target=self._work, args=(Worker(),), daemon=True, name=f"colocate-{self.name}").start()

    def _work(self, worker: Worker) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            with self._lock:
                self._queued -= 1
                if call.state != "queued":  # timed out while it waited
                    continue
                self._idle -= 1
                call.state, call.worker = "running", worker
            outcome = run_boxed(call.fn, call.args, call.kwargs)
            with self._lock:
                if call.state == "running":
                    call.state = "done"
                    call.future.set_result(outcome)
                if worker.abandoned:
                    self.hung -= 1
                    self._fill()
                    return
                self._idle += 1
