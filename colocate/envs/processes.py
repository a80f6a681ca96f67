"""`EnvProcesses`: the run's env in N worker processes, behind the same `Env` protocol.

`env.processes: N` (per inference rank) builds N copies of the env, each in its own spawned process
and seeded apart, and gives copy i the groups whose id is i modulo N. The loop that feeds the engine
then only routes: `start_group` and `step` are sent to the copy that owns the group and return at
once; the copy applies them and sends back the requests that became ready (their constraint tables
already built) and the samples of groups that finished. `requests()` and `pop_finished()` take
what has arrived without waiting; `settle()` waits for every reply, and the rollout worker calls it
when the engine has nothing in flight. `has_news()` tells a streamed engine poll to return early,
so a phase built by a copy is submitted without waiting for the engine's next finished request.

Why: on one GPU the Diplomacy rollout is bound by the process that feeds the engine, not by the GPU:
legal orders, adjudication, prompts and constraint tables ran on that loop while it held the GIL
(profiles/README.md, "where the inference rank's time goes"). Threads would not help.

What changes for the user: samples arrive as the copies finish them, so the order of groups within
a batch follows timing. The exact-resume mode (`rollout.update: drain` without oversampling) keeps
the env in-process (`config_checks` refuses the pair). Metrics are merged by the env class's
`merge_metrics`; the resume state is one state per copy; `data_stats` are the first copy's;
evaluation uses a copy of the env built in this process when first asked. A copy that raises
stops the run with its traceback. Stop signals are the rank's: a copy ignores them, also while it
starts up. The copies end when their pipes close: `close()`, or at exit (also after a failure).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.util as mp_util
import queue
import signal
import threading
import traceback
from multiprocessing import resource_tracker
from multiprocessing.reduction import ForkingPickler
from typing import Hashable

from colocate.config_checks import ConfigError
from colocate.data import Completion, Request, Sample
from colocate.envs.base import Env, ResumeError
from colocate.envs.protocol import is_keyed_request
from colocate.lifecycle import spawn_without_main


STATE_KEY = "env_processes"
"""The resume state of `EnvProcesses`: {STATE_KEY: [each copy's state]}."""


def saved_processes(state) -> int:
    """env.processes of the run that saved an env resume state (0: the env was in-process)."""
    parts = state.get(STATE_KEY) if isinstance(state, dict) else None
    return len(parts) if isinstance(parts, list) else 0


def check_processes(cfg) -> None:
    """env.processes against the rollout mode: copies hand samples back as they finish, not in order."""
    r = cfg.rollout
    if cfg.env.processes > 0 and r.update == "drain" and r.oversample_groups == 0:
        raise ConfigError(f"env.processes={cfg.env.processes} with rollout.update=drain and no oversample_groups: "
                          "that mode resumes exactly, which needs samples in the in-process env's order (env "
                          "processes hand them back as they finish); set env.processes=0 or oversample_groups > 0")


def check_resume_processes(saved: list[dict], cfg) -> None:
    """An env resume state saved by N copies (`env.processes`) holds one state per copy, each for
    its own groups: it resumes only with N copies (an env that keeps no state resumes with any)."""
    for state in saved:
        if saved_processes(state) != cfg.env.processes:
            raise ResumeError(f"saved with env.processes={saved_processes(state)}, this run has "
                              f"env.processes={cfg.env.processes}: resume with the saved number")


class EnvProcessError(RuntimeError):
    """A copy of the env raised in its worker process; the message holds its traceback."""


def _serve(conn, env_type: type[Env], cfg, tokenizer, seed: int) -> None:
    """One worker process: build the env, then answer messages until the pipe closes (the inference
    rank is gone). Each reply is pickled here, so one that cannot be is an error reply, not a lost
    one; it leaves from a thread, so this loop keeps reading while a large reply waits for the rank
    to take it (else both sides could block in send, each on a full pipe). Stop signals are the
    rank's to handle (it finishes its step and checkpoints), so a copy ignores them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked since the spawn: what came meanwhile is dropped
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_send_all, args=(conn, outbox), daemon=True).start()
    try:
        env = env_type.from_config(cfg, tokenizer, seed=seed)
        outbox.put(_pickled(lambda: env.group_size))
    except BaseException:
        outbox.put(_pickled_error())
        env = None
    sent: set = set()  # keys whose requests went out and have not been answered
    while True:
        try:
            op, arg = conn.recv()
        except (EOFError, OSError):
            outbox.put(None)
            return
        if env is not None:
            outbox.put(_pickled(lambda: _answer(env, sent, op, arg)))


def _answer(env: Env, sent: set, op: str, arg):
    """Apply one message -> its reply's value: after `start` and `step`, (the new (key, Request)
    pairs, the other items `requests()` returned, the finished samples, and `(result,)` when
    `pop_finished()` returned no list, else `()`); otherwise the query's answer."""
    if op == "start":
        env.start_group(arg)
    elif op == "step":
        sent.difference_update(arg)
        env.step(arg)
    else:
        return _query(env, op, arg)
    finished = env.pop_finished()
    if not isinstance(finished, list | tuple):  # garbled (None too): sent as it is, in a 1-tuple
        return (*_new_requests(env, sent), [], (finished,))
    return (*_new_requests(env, sent), list(finished), ())


def _pickled(value_fn) -> bytes:
    """("ok", value_fn()) pickled, or the error reply when computing or pickling it raised."""
    try:
        return ForkingPickler.dumps(("ok", value_fn()))
    except BaseException:
        return _pickled_error()


def _pickled_error() -> bytes:
    return ForkingPickler.dumps(("error", traceback.format_exc()))


def _send_all(conn, outbox: queue.SimpleQueue) -> None:
    while (payload := outbox.get()) is not None:
        try:
            conn.send_bytes(payload)
        except OSError:  # the inference rank is gone
            return


def _query(env: Env, op: str, arg):
    if op == "metrics":
        return env.metrics()
    if op == "state":
        return env.state_dict()
    if op == "load":
        return env.load_state_dict(arg)
    if op == "data_stats":
        return env.data_stats()
    raise ValueError(f"unknown message {op!r}")


def _new_requests(env: Env, sent: set) -> tuple[list, list]:
    """The env's waiting (key, Request) pairs not sent before, with their constraint tables built
    here (the engine asks each constraint for its table), and the items that are no such pair, as
    they are, for the rollout worker's check to count."""
    returned = env.requests()
    pairs, bad = [], []
    for item in list(returned) if isinstance(returned, list | tuple) else [returned]:
        if not is_keyed_request(item):
            bad.append(item)
        elif item[0] not in sent:
            sent.add(item[0])
            if item[1].constraint is not None and item[1].constraint.slots:
                item[1].constraint.table()
            pairs.append(item)
    return pairs, bad


def _close_copies(conns: list, procs: list) -> None:
    """Close the pipes (each copy then returns) and reap the copies; kill one that does not return."""
    for conn in conns:
        conn.close()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():  # copies ignore SIGTERM (the rank's to handle)
            proc.kill()
            proc.join(timeout=5)


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def stop_signals_blocked():
    """SIGINT and SIGTERM held back on this thread while a copy is spawned. The copy inherits the
    mask, so a stop requested during its start-up (seconds of imports) waits until `_serve` ignores
    it instead of killing the copy; here it is delivered (not lost) when the block ends."""
    resource_tracker.ensure_running()  # started on a first spawn, it would unblock them on its way out
    saved = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, saved)


class EnvProcesses(Env):
    """`num` copies of `env_type` in spawned processes; see the module docstring."""

    def __init__(self, env_type: type[Env], cfg, tokenizer, seed: int, num: int):
        if num < 1:
            raise ValueError(f"EnvProcesses needs at least one process, not {num}")
        self.env_type, self.cfg, self.tokenizer, self.seed = env_type, cfg, tokenizer, seed
        ctx = mp.get_context("spawn")  # the parent holds CUDA and threads: never fork it
        self._conns, self._procs = [], []
        # Closes the pipes at exit before multiprocessing joins its children: a copy ignores SIGTERM
        # and would wait on its pipe forever when a failed rank's traceback still holds this env.
        self._close = mp_util.Finalize(self, _close_copies, args=(self._conns, self._procs), exitpriority=10)
        try:
            for i in range(num):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(theirs, env_type, cfg, tokenizer, seed * num + i),
                                   name=f"colocate-env-{i}", daemon=True)
                # a Ctrl-C while the copy starts up is the rank's to handle; a class defined in the
                # main module needs that module run again in the copy, any other does not
                with stop_signals_blocked(), \
                        spawn_without_main() if env_type.__module__ != "__main__" else contextlib.nullcontext():
                    proc.start()
                theirs.close()
                self._conns.append(ours)
                self._procs.append(proc)
        except BaseException:
            self.close()
            raise
        self._pending = [0] * num                          # replies each process still owes
        self._waiting: dict[Hashable, Request] = {}        # requests ready and not yet answered
        self._owner: dict[Hashable, int] = {}              # key -> the process that asked
        self._bad: list = []                               # items that were not (key, Request) pairs
        self._finished: list[Sample] = []
        self._garbled: tuple = ()                           # (a pop_finished() result that was no list,)
        self._local: Env | None = None
        try:
            self.group_size = [self._reply(i, starting=True) for i in range(num)][0]
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ Env protocol

    def start_group(self, group_id: int) -> None:
        self._send(group_id % len(self._conns), "start", group_id)

    def requests(self) -> list[tuple[Hashable, Request]]:
        self._take(wait=False)
        bad, self._bad = self._bad, []
        return list(self._waiting.items()) + bad

    def step(self, completions: dict[Hashable, Completion]) -> None:
        parts: dict[int, dict] = {}
        for key, completion in completions.items():
            if key not in self._owner:
                raise KeyError(f"completion for {key} was not requested")
            parts.setdefault(self._owner.pop(key), {})[key] = completion
            del self._waiting[key]
        for i, part in parts.items():
            self._send(i, "step", part)

    def pop_finished(self) -> list[Sample]:
        self._take(wait=False)
        out, self._finished = self._finished, []
        if self._garbled:  # one per call, as from an env in this process: the check counts it
            out.append(self._garbled[0])
            self._garbled = ()
        return out

    def settle(self) -> None:
        self._take(wait=True)

    def has_news(self) -> bool:
        return any(n and conn.poll() for n, conn in zip(self._pending, self._conns))

    # ------------------------------------------------------------------ the rest of Env

    def metrics(self) -> dict[str, float]:
        return self.env_type.merge_metrics(self._ask_all("metrics"))

    def state_dict(self) -> dict | None:
        parts = self._ask_all("state")
        return None if all(p is None for p in parts) else {STATE_KEY: parts}

    def load_state_dict(self, state: dict) -> None:
        parts = state.get(STATE_KEY)
        if not isinstance(parts, list) or len(parts) != len(self._conns):
            raise ValueError(f"the resume state holds the env of {saved_processes(state)} processes, this run has "
                             f"env.processes={len(self._conns)}: resume with the same number")
        self.settle()
        for i, part in enumerate(parts):
            if part is not None:
                self._ask(i, "load", part)

    def data_stats(self) -> dict[str, float]:
        """The first copy's (every copy opened the same data)."""
        self.settle()
        return self._ask(0, "data_stats")

    def evaluate(self, engine, eval_cfg, out_dir: str | None = None) -> dict[str, float]:
        return self.local().evaluate(engine, eval_cfg, out_dir)

    def local(self) -> Env:
        """A copy of the env in this process (evaluation), built when first asked."""
        if self._local is None:
            self._local = self.env_type.from_config(self.cfg, self.tokenizer, seed=self.seed)
        return self._local

    def close(self) -> None:
        self._close()  # once; at exit if never called

    # ------------------------------------------------------------------ messages

    def _send(self, i: int, op: str, arg) -> None:
        try:
            self._conns[i].send((op, arg))
        except OSError:
            raise self._died(i) from None
        self._pending[i] += 1

    def _died(self, i: int, starting: bool = False) -> EnvProcessError:
        self._procs[i].join(timeout=1)
        hint = ("; it died before building the env: a spawned process imports the main module again, so a "
                "script that starts training must do so under `if __name__ == \"__main__\":`") if starting else ""
        return EnvProcessError(f"env process {i} ({self.env_type.__name__}) is gone (exit code "
                               f"{self._procs[i].exitcode}; a negative code is the signal that ended it){hint}")

    def _ask(self, i: int, op: str, arg=None):
        """Copy i's answer to one query (after `settle`: no other reply is owed before it)."""
        self._send(i, op, arg)
        return self._take_one(i)

    def _ask_all(self, op: str) -> list:
        self.settle()
        for i in range(len(self._conns)):
            self._send(i, op, None)
        return [self._take_one(i) for i in range(len(self._conns))]

    def _take(self, wait: bool) -> None:
        """File the replies that have arrived (all that are owed, with `wait`)."""
        for i, conn in enumerate(self._conns):
            while self._pending[i] and (wait or conn.poll()):
                pairs, bad, finished, garbled = self._take_one(i)
                for key, request in pairs:
                    self._waiting[key] = request
                    self._owner[key] = i
                self._bad.extend(bad)
                self._finished.extend(finished)
                self._garbled = garbled or self._garbled

    def _take_one(self, i: int):
        self._pending[i] -= 1
        return self._reply(i)

    def _reply(self, i: int, starting: bool = False):
        try:
            status, value = self._conns[i].recv()
        except (EOFError, OSError):
            raise self._died(i, starting) from None
        if status == "error":
            raise EnvProcessError(f"env process {i} ({self.env_type.__name__}) raised:\n{value.rstrip()}")
        return value
