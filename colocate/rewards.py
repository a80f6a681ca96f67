"""Reward functions of the dataset env: built-ins, a user's by path, several summed with weights.

Every function has TRL's signature, so an existing TRL reward function works unchanged:

    fn(prompts, completions, **columns) -> list[float]     # one reward per completion

`prompts` and `completions` are strings, or for chat prompts lists of messages with the completion
as one assistant message (as TRL passes them); `columns` holds every other column of the rows,
one value per completion. A group's G completions of one prompt go in one call.

Every call runs in a box (`colocate.calls`) with a time limit (`env.reward_timeout_s`). A result
that cannot be used (the function raised - a `BaseException` such as `SystemExit` too -, did not
answer in time, returned the wrong length, None, NaN or inf, or a value beyond +-`env.reward_max_abs`)
scores the sample 0 from that function, is counted (`rollout/reward_errors` and
`rollout/reward_errors/<kind>`) and logged once per function and kind of fault with the offending
sample; `max_errors` bad samples in a row from one function stop the run with a `RewardError`
naming the function, since by then the function is broken, not the data.
"""
from __future__ import annotations

import math
import numbers
import re
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from colocate.calls import CallPool, run_boxed

NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")  # ASCII digits only: int() also takes other scripts


class RewardError(RuntimeError):
    """Too many unusable reward results in a row."""


def completion_text(completion) -> str:
    """The text of a completion: a string, or the content of its (last) message."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def parse_number(text: str) -> Fraction | None:
    """'1,234.50' -> Fraction; None when not a number."""
    try:
        return Fraction(text.replace(",", "").rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | None:
    found = NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def gsm8k_reference(answer: str) -> Fraction | None:
    """GSM8K's answer field ends in '#### N'; a bare number is taken as it is."""
    text = str(answer)
    return parse_number(text.rpartition("####")[2].strip()) if "####" in text else last_number(text)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces matched; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def gsm8k(prompts, completions, *, answer_column: str = "answer", **columns) -> list[float]:
    """1.0 when the completion's last number equals the answer's '#### N'."""
    out = []
    for completion, answer in zip(completions, columns[answer_column]):
        value, ref = last_number(completion_text(completion)), gsm8k_reference(answer)
        out.append(float(value is not None and value == ref))
    return out


def boxed(prompts, completions, *, answer_column: str = "answer", **columns) -> list[float]:
    """1.0 when the completion's last \\boxed{} holds exactly the answer (its own \\boxed{} if it has one)."""
    out = []
    for completion, answer in zip(completions, columns[answer_column]):
        got, ref = last_boxed(completion_text(completion)), last_boxed(str(answer))
        out.append(float(got is not None and got == (ref if ref is not None else str(answer).strip())))
    return out


def exact(prompts, completions, *, answer_column: str = "answer", **columns) -> list[float]:
    """1.0 when the stripped completion equals the stripped answer."""
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, columns[answer_column])]


def is_sequence(values) -> bool:
    """A list-like of values with a length (a list, tuple, NumPy array, tensor), not a string or an
    iterator (a generator would be consumed by the length check)."""
    if isinstance(values, (str, bytes, dict)) or values is None:
        return False
    return hasattr(values, "__len__") and hasattr(values, "__getitem__") and getattr(values, "ndim", 1) == 1


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


BUILTINS = {"gsm8k": gsm8k, "boxed": boxed, "exact": exact}


def load_reward(name: str, answer_column: str):
    """A built-in (bound to the answer column) or a user's function by path -> callable."""
    if name in BUILTINS:
        fn = BUILTINS[name]
        return lambda prompts, completions, **columns: fn(prompts, completions, answer_column=answer_column,
                                                         **columns)
    from colocate.objects import ObjectPathError, load_object
    fn = load_object(name)
    if not callable(fn):
        raise ObjectPathError(f"{name!r} is not callable (a reward function is fn(prompts, completions, **columns))")
    return fn


def defined_at(fn) -> str:
    """Where a function is defined, `file:line` (relative to the working directory), or its repr."""
    import inspect
    from colocate.lifecycle import shown_path
    try:
        return f"{shown_path(inspect.getsourcefile(fn))}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return repr(fn)


def check_reward(name: str, fn, row: "RewardRow", limits: "RewardLimits") -> str | None:
    """Call a user's reward function as the dataset env will, on one row: its prompt twice, with the
    row's answer and a wrong one as completions (messages for a chat prompt), each other column
    once per completion, in the run's box (`evaluate`, `env.reward_timeout_s`) -> what is wrong,
    naming the function and where (None: it works, or gave no answer in time: the run's own
    timeout deals with that). Before launch a wrong signature, a raise on the first row or an
    unusable result is a config error, not `env.max_reward_errors` counted errors into the run."""
    import inspect
    from colocate.chat import is_messages
    from colocate.lifecycle import failure_frame, shown_path
    texts = [str(row.answer) if row.answer is not None else "", "I do not know."]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if is_messages(row.prompt) else texts
    kwargs = {"prompts": [row.prompt] * 2, "completions": completions, **{k: [v] * 2 for k, v in row.columns.items()}}
    where = f"{name} ({defined_at(fn)})"
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        return (f"{where} cannot be called as TRL calls a reward function, fn(prompts=, completions=, **columns) "
                f"with columns {', '.join(row.columns) or '(none)'}: {e} (add **kwargs to take the columns it ignores)")
    except ValueError:  # no signature to read (a builtin): calling it says
        pass
    outcome = CallPool(1, "reward-check").run(evaluate, limits.timeout_s, fn, 2, limits.max_abs, kwargs)
    scores = outcome.value if outcome.kind == "value" else None
    if scores is None or not any(scores.faults):
        return None
    frame = failure_frame(scores.error) if scores.error is not None else None
    at = f" at {shown_path(frame.filename)}:{frame.lineno}" if frame else ""
    return f"{where} {scores.detail}{at} on the first row (a reward must score any completion)"


@dataclass
class RewardRow:
    """One data row as a reward function gets it: the prompt, the answer, every other column."""
    prompt: object
    answer: object
    columns: dict


REWARD_ERROR_KINDS = ("raised", "base_exception", "timeout", "not_a_list", "wrong_length", "not_a_number",
                      "non_finite", "out_of_range")
"""Every kind of unusable reward result, counted in samples as `rollout/reward_errors/<kind>`."""


@dataclass
class Scores:
    """One function's results over a group: a float or None per completion, the fault of each None."""
    values: list
    faults: list
    detail: str = ""
    """What the first fault was, for the log line."""
    position: int = 0
    """The completion it was found at."""
    error: BaseException | None = None
    """What the function raised (the cause a RewardError names: its file and line)."""


def check_number(v, max_abs: float) -> str | None:
    """None for a usable reward value, else its fault kind."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return "not_a_number"
    try:
        f = float(v)
    except (OverflowError, ValueError, TypeError):  # an int too large for a float
        return "out_of_range"
    if not math.isfinite(f):
        return "non_finite"
    return "out_of_range" if abs(f) > max_abs else None


def check_scores(values, n: int, max_abs: float) -> Scores:
    """A function's return value -> Scores (runs in the call's worker: a user's object may misbehave)."""
    if not is_sequence(values):
        return Scores([None] * n, ["not_a_list"] * n, f"returned {type(values).__name__} {_short(values)}, "
                      f"expected a list of {n} numbers (one per completion)")
    if len(values) != n:
        return Scores([None] * n, ["wrong_length"] * n, f"returned {len(values)} values for {n} completions")
    faults = [check_number(v, max_abs) for v in values]
    first = next((i for i, f in enumerate(faults) if f), 0)
    detail = "" if faults[first] is None else (
        f"returned {type(values[first]).__name__} {_short(values[first])} at position {first}, expected a finite "
        f"number within +-{max_abs:g} (env.reward_max_abs)")
    return Scores([None if f else float(v) for v, f in zip(values, faults)], faults, detail, first)


def evaluate(fn, n: int, max_abs: float, kwargs: dict) -> Scores:
    """`fn(**kwargs)` and its result checked, in the call's worker; never raises."""
    outcome = run_boxed(fn, kwargs=kwargs)
    if outcome.kind != "value":
        what = " (a BaseException, caught in the reward's box)" if outcome.kind == "base_exception" else ""
        return Scores([None] * n, [outcome.kind] * n, f"raised {outcome.describe()}{what}", error=outcome.error)
    checked = run_boxed(check_scores, (outcome.value, n, max_abs))
    if checked.kind != "value":
        return Scores([None] * n, ["not_a_list"] * n, f"returned a {type(outcome.value).__name__} that could not be "
                      f"read as {n} numbers ({checked.describe()})")
    return checked.value


@dataclass
class RewardLimits:
    """How reward functions are bounded (env.* keys)."""
    max_errors: int = 100
    """Bad samples in a row from one function that stop the run (env.max_reward_errors)."""
    timeout_s: float = 30.0
    """A call not answered within this is a timeout (env.reward_timeout_s)."""
    max_abs: float = 1e6
    """A value beyond +-this is out_of_range (env.reward_max_abs)."""
    workers: int = 1
    """Calls at once (the scoring threads: env.reward_workers, at least 1)."""


class RewardSet:
    """The configured functions with their weights, and the count of unusable results. Every call
    runs in a box (`colocate.calls`): a time limit, every exception (SystemExit too) an outcome."""

    def __init__(self, names: list[str], weights: list[float], *, answer_column: str = "answer",
                 limits: RewardLimits | None = None):
        self.names = list(names)
        self.fns = [load_reward(n, answer_column) for n in self.names]
        self.weights = [float(w) for w in weights] or [1.0] * len(self.fns)
        self.limits = limits or RewardLimits()
        self.max_errors = self.limits.max_errors
        self.pool = CallPool(self.limits.workers, "reward")
        self.errors = 0              # bad samples since the last `take_error_counts`
        self.kinds: Counter = Counter()  # bad samples by (function's) fault kind, since then
        self.in_a_row: Counter = Counter()  # function -> its bad samples since its last good one
        self._logged: set = set()
        self._lock = threading.Lock()  # scoring threads (`env.reward_workers`) share the counts

    def score(self, prompts: list, completions: list, columns: dict[str, list]) -> tuple[list[float], list[bool]]:
        """Weighted sum per completion, and whether each sample had an unusable result (a bad value
        adds nothing: the sample scores 0 from that function)."""
        n = len(completions)
        total, bad = [0.0] * n, [False] * n
        for name, fn, weight in zip(self.names, self.fns, self.weights):
            kwargs = {"prompts": prompts, "completions": completions, **columns}  # by keyword, as TRL calls them
            scores = self._run(n, evaluate, fn, n, self.limits.max_abs, kwargs)
            self._record(name, scores, prompts, completions)
            for i, v in enumerate(scores.values):
                if v is None:
                    bad[i] = True
                else:
                    total[i] += weight * v
        with self._lock:
            self.errors += sum(bad)
        return total, bad

    def score_one(self, name: str, fn) -> float | None:
        """One number from `fn()` (an environment's get_reward), in the same box -> it, or None."""
        scores = self._run(1, evaluate_one, fn, self.limits.max_abs)
        self._record(name, scores, [""], [""])
        with self._lock:
            self.errors += scores.values[0] is None
        return scores.values[0]

    def _run(self, n: int, check, *args) -> Scores:
        """`check(*args)` (`evaluate`, `evaluate_one`) in the box -> its Scores, or n timeouts."""
        outcome = self.pool.run(check, self.limits.timeout_s, *args)
        if outcome.kind == "value":  # the checks never raise: any other outcome is the deadline
            return outcome.value
        return Scores([None] * n, ["timeout"] * n, f"gave no answer within env.reward_timeout_s="
                      f"{self.limits.timeout_s:g}s (its thread is abandoned)")

    def _record(self, name: str, scores: Scores, prompts, completions) -> None:
        """Count the faults by kind, log the first of each kind once, stop on too many in a row."""
        kind = next((f for f in scores.faults if f), None)
        if kind is not None:
            i = scores.position
            self._log_once(name, kind, scores.detail, prompts[min(i, len(prompts) - 1)], completions[i])
        with self._lock:
            for fault in scores.faults:
                if fault is None:
                    self.in_a_row[name] = 0
                    continue
                self.kinds[fault] += 1
                self.in_a_row[name] += 1
                if self.in_a_row[name] > self.max_errors:
                    raise RewardError(f"reward {name} gave no usable value for {self.in_a_row[name]} samples in a "
                                      f"row (env.max_reward_errors={self.max_errors}); the last {scores.detail} "
                                      f"(rollout/reward_errors/{fault})") from scores.error

    def _log_once(self, name: str, kind: str, what: str, prompt, completion) -> None:
        with self._lock:
            if (name, kind) in self._logged:
                return
            self._logged.add((name, kind))
        print(f"colocate: reward function {name} {what}; the sample scores 0 from it and is counted under "
              f"rollout/reward_errors/{kind} (logged once): prompt={str(prompt)[-200:]!r} "
              f"completion={str(completion)[:200]!r}", file=sys.stderr, flush=True)

    def take_error_counts(self) -> dict[str, float]:
        """Bad samples since the last call: in all (`reward_errors`) and by kind (a sample bad from
        two functions counts once in all, under each function's kind)."""
        with self._lock:
            n, kinds, self.errors, self.kinds = self.errors, self.kinds, 0, Counter()
        return {"reward_errors": float(n), **{f"reward_errors/{k}": float(kinds[k]) for k in REWARD_ERROR_KINDS}}

    def take_errors(self) -> int:
        """Bad samples since the last call (the counts by kind too are reset)."""
        return int(self.take_error_counts()["reward_errors"])

    def restore_error_counts(self, counts: dict[str, float]) -> None:
        """Put back what `take_error_counts` returned (an evaluation's own faults kept out of training's)."""
        with self._lock:
            self.errors = int(counts["reward_errors"])
            self.kinds = Counter({k: int(counts[f"reward_errors/{k}"]) for k in REWARD_ERROR_KINDS})

    def close(self) -> None:
        self.pool.close()


def evaluate_one(fn, max_abs: float) -> Scores:
    """`fn()` that returns one number, checked, in the call's worker."""
    outcome = run_boxed(fn)
    if outcome.kind != "value":
        return Scores([None], [outcome.kind], f"raised {outcome.describe()}")
    fault = check_number(outcome.value, max_abs)
    return Scores([None if fault else float(outcome.value)], [fault],
                  f"returned {type(outcome.value).__name__} {_short(outcome.value)}, expected a finite number within "
                  f"+-{max_abs:g} (env.reward_max_abs)" if fault else "")
