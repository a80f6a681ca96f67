"""Reward functions of the dataset env: built-ins, a user's by path, several summed with weights.

Every function has TRL's signature, so an existing TRL reward function works unchanged:

    fn(prompts, completions, **columns) -> list[float]     # one reward per completion

`prompts` and `completions` are strings, or for chat prompts lists of messages with the completion
as one assistant message (as TRL passes them); `columns` holds every other column of the rows,
one value per completion. A group's G completions of one prompt go in one call.

A result that cannot be used (the function raised, returned the wrong length, a NaN or None) scores
the sample 0 from that function, is counted (`rollout/reward_errors`) and logged once per function
and kind of fault with the offending sample; `max_errors` bad samples in a row stop the run with a
`RewardError` naming the function, since by then the function is broken, not the data.
"""
from __future__ import annotations

import math
import numbers
import re
import sys
import threading
from fractions import Fraction

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


class RewardSet:
    """The configured functions with their weights, and the count of unusable results."""

    def __init__(self, names: list[str], weights: list[float], *, answer_column: str = "answer",
                 max_errors: int = 100):
        self.names = list(names)
        self.fns = [load_reward(n, answer_column) for n in self.names]
        self.weights = [float(w) for w in weights] or [1.0] * len(self.fns)
        self.max_errors = max_errors
        self.errors = 0          # bad samples since the last `take_errors`
        self.in_a_row = 0        # bad samples since the last good one
        self._logged: set = set()
        self._lock = threading.Lock()  # scoring threads (`env.reward_workers`) share the counts

    def score(self, prompts: list, completions: list, columns: dict[str, list]) -> tuple[list[float], list[bool]]:
        """Weighted sum per completion, and whether each sample had an unusable result."""
        n = len(completions)
        total, bad = [0.0] * n, [False] * n
        for name, fn, weight in zip(self.names, self.fns, self.weights):
            values = self._call(name, fn, prompts, completions, columns)
            for i, v in enumerate(values):
                if v is None:
                    bad[i] = True
                else:
                    total[i] += weight * v
        for i, is_bad in enumerate(bad):
            self._count(is_bad, self.names)
        return total, bad

    def _call(self, name: str, fn, prompts, completions, columns) -> list[float | None]:
        """One function over the group -> a float per completion, None where unusable (logged once)."""
        n = len(completions)
        try:
            values = fn(prompts=prompts, completions=completions, **columns)  # by keyword, as TRL calls them
        except Exception as e:  # noqa: BLE001 - a user's function; counted, not fatal at once
            self._log_once(name, "raised", f"{type(e).__name__}: {e}", prompts[0], completions[0])
            return [None] * n
        if not is_sequence(values):
            self._log_once(name, "not a list", f"returned {type(values).__name__} {_short(values)}, expected a list "
                           f"of {n} numbers (one per completion)", prompts[0], completions[0])
            return [None] * n
        if len(values) != n:
            self._log_once(name, "wrong length", f"returned {len(values)} values for {n} completions",
                           prompts[0], completions[0])
            return [None] * n
        out = []
        for i, v in enumerate(values):
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
            if not ok:
                self._log_once(name, "bad value", f"returned {type(v).__name__} {_short(v)} at position {i}, "
                               "expected a finite number", prompts[i], completions[i])
            out.append(float(v) if ok else None)
        return out

    def _count(self, is_bad: bool, names) -> None:
        with self._lock:
            self._count_locked(is_bad, names)

    def _count_locked(self, is_bad: bool, names) -> None:
        if not is_bad:
            self.in_a_row = 0
            return
        self.errors += 1
        self.in_a_row += 1
        if self.in_a_row > self.max_errors:
            raise RewardError(f"{self.in_a_row} samples in a row got no usable reward from {', '.join(names)} "
                              f"(env.max_reward_errors={self.max_errors}); the first fault was logged above: "
                              "fix the function or the data")

    def _log_once(self, name: str, kind: str, what: str, prompt, completion) -> None:
        with self._lock:
            if (name, kind) in self._logged:
                return
            self._logged.add((name, kind))
        print(f"colocate: reward function {name} {what}; the sample scores 0 from it and is counted under "
              f"rollout/reward_errors (logged once): prompt={str(prompt)[-200:]!r} "
              f"completion={str(completion)[:200]!r}", file=sys.stderr, flush=True)

    def take_errors(self) -> int:
        """Bad samples since the last call."""
        with self._lock:
            n, self.errors = self.errors, 0
        return n
