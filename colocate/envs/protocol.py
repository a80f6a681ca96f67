"""A user's env class against the `Env` protocol: checked by signature before launch, and its
results checked at run time.

Before launch (`preflight`, so `--check` too): `from_config(cfg, tokenizer, seed)` and the four
loop methods are the class's own (not `Env`'s, which only raise) and take the arguments the role
loop passes; `env.options` names only parameters of the class's constructor (unless it takes
`**kwargs`). Each mismatch is one line naming the class and the method or option.

At run time (`RolloutWorker`): what `requests()` and `pop_finished()` return is checked item by
item; an item of the wrong shape is dropped, logged once per method with what it was and what
was expected, and counted (`rollout/env_errors`), and `env.max_reward_errors` of them in a row stop
the run (the policy of reward functions, `colocate.rewards`).
"""
from __future__ import annotations

import difflib
import inspect
import sys

from colocate.data import Request, Sample
from colocate.envs.base import Env

LOOP_METHODS = {"start_group": ("group_id",), "requests": (), "step": ("completions",), "pop_finished": ()}
"""The methods the role loop calls, with the arguments it passes."""


class EnvProtocolError(TypeError):
    """An env class that the role loop could not drive; the message names the method or option."""


class EnvResultError(RuntimeError):
    """Too many unusable results from an env's methods in a row."""


def _accepts(fn, args: tuple, keywords: tuple = ()) -> bool:
    try:
        inspect.signature(fn).bind(*[None] * len(args), **dict.fromkeys(keywords))
    except (TypeError, ValueError):
        return False
    return True


def check_env_class(cls: type, options: dict) -> None:
    """Raise `EnvProtocolError` at the first way `cls` does not follow the protocol."""
    name = cls.__name__
    if inspect.getattr_static(cls, "from_config") is inspect.getattr_static(Env, "from_config"):
        raise EnvProtocolError(f"{name} does not define from_config(cls, cfg, tokenizer, seed) (docs/envs.md)")
    if not _accepts(cls.from_config, ("cfg", "tokenizer"), ("seed",)):  # as `make_env` calls it
        raise EnvProtocolError(f"{name}.from_config{inspect.signature(cls.from_config)} cannot be called as "
                               "from_config(cfg, tokenizer, seed)")
    for method, args in LOOP_METHODS.items():
        if getattr(cls, method) is getattr(Env, method):
            raise EnvProtocolError(f"{name} does not implement {method}({', '.join(args)}) (the Env protocol: "
                                   "docs/envs.md)")
        if not _accepts(getattr(cls, method), ("self",) + args):
            raise EnvProtocolError(f"{name}.{method}{inspect.signature(getattr(cls, method))} cannot be called as "
                                   f"{method}({', '.join(args)})")
    check_options(cls, options)


def check_options(cls: type, options: dict) -> None:
    """Each key of env.options is a keyword parameter of the constructor (or it takes **kwargs)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if n != "self" and p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                                         inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for key in options:
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f" (its parameters: {', '.join(names)})"
            raise EnvProtocolError(f"env.options: {key!r} is no parameter of {cls.__name__}.__init__{hint}")


class ResultCheck:
    """Checks what an env's methods return; counts and logs the unusable items."""

    def __init__(self, env: Env, max_errors: int):
        self.name, self.max_errors = type(env).__name__, max_errors
        self.errors = 0          # unusable items since the last `take_errors`
        self.in_a_row = 0
        self._logged: set = set()

    def requests(self, returned, known: set | frozenset = frozenset()) -> list:
        """`requests()`'s result -> its (key, Request) pairs, less those whose key is in `known` (in
        flight: checked when first returned, and skipped at the cost of a set lookup); anything else
        is counted."""
        items = self._sequence("requests", returned, "a list of (key, Request) pairs")
        if known:
            fresh = [item for item in items if not _is_known(item, known)]
            if len(fresh) < len(items):  # usable items came back (what `in_a_row` counts between)
                self.in_a_row = 0
            items = fresh
        return [item for item in items if self._item_ok("requests", item, is_keyed_request(item),
                                                        "a (hashable key, Request) pair")]

    def samples(self, returned) -> list:
        """`pop_finished()`'s result -> its Samples; anything else is counted."""
        items = self._sequence("pop_finished", returned, "a list of Samples")
        return [item for item in items if self._item_ok("pop_finished", item, isinstance(item, Sample),
                                                        "a colocate.data.Sample")]

    def _sequence(self, method: str, returned, expected: str) -> list:
        if isinstance(returned, list | tuple):
            return list(returned)
        self._bad(method, f"returned {_show(returned)}", expected)
        return []

    def _item_ok(self, method: str, item, ok: bool, expected: str) -> bool:
        if ok:
            self.in_a_row = 0
            return True
        self._bad(method, f"returned an item {_show(item)}", expected)
        return False

    def _bad(self, method: str, what: str, expected: str) -> None:
        self.errors += 1
        self.in_a_row += 1
        if method not in self._logged:
            self._logged.add(method)
            print(f"colocate: env {self.name}.{method}() {what}, expected {expected}; dropped and counted "
                  "under rollout/env_errors (logged once)", file=sys.stderr, flush=True)
        if self.in_a_row > self.max_errors:
            raise EnvResultError(f"{self.in_a_row} results in a row of env {self.name}.{method}() were unusable "
                                 f"({what}, expected {expected}; env.max_reward_errors={self.max_errors})")

    def take_errors(self) -> int:
        n, self.errors = self.errors, 0
        return n


def is_keyed_request(item) -> bool:
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Request)):
        return False
    try:
        hash(item[0])
    except TypeError:
        return False
    return True


def _is_known(item, known) -> bool:
    """Whether `item` is a pair whose key is in `known` (a key that cannot be hashed is not)."""
    try:
        return isinstance(item, tuple) and len(item) == 2 and item[0] in known
    except TypeError:
        return False


def _show(value) -> str:
    """A value for a message: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:80] + '...' if len(text) > 80 else text}"
