"""Tool calls of an agent: parsing them out of sampled text, running them off the rollout loop.

Tool arguments come from sampled text, so they are untrusted input: a call that cannot be used
(unknown tool, text that is not the call format's JSON, arguments the function does not take, a
function that raises or outlasts `timeout_s`, output longer than `max_output_chars`) becomes a tool
message the policy reads on its next turn, with its kind counted (`rollout/tool_errors/<kind>`);
nothing here raises into the rollout. The text is parsed within bounds (`MAX_CALL_CHARS`,
`MAX_JSON_DEPTH`, `MAX_INT_DIGITS`): any text is a call or a kind, never an exception.

Parsers are chosen by name (`env.tool_parser`): `hermes` is the Hermes / Qwen format,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.

Tools run on a fixed pool of `max_workers` daemon threads (`colocate.calls`), so a hung tool never
blocks the engine feeding nor the process's exit; its thread cannot be killed, only abandoned and
replaced (a bounded number of them), which is why a tool that runs code should run it in a
subprocess with limits (docs/agents.md), and why an episode has a tool time budget.
"""
from __future__ import annotations

import inspect
import math
import json
import re
from dataclasses import dataclass

from colocate.calls import Call, CallPool, run_boxed, wait_first

TOOL_ERROR_KINDS = ("unknown_tool", "invalid_json", "too_deep", "too_large", "wrong_arguments", "raised",
                    "base_exception", "unrenderable", "timeout", "over_budget", "output_too_long")
"""Every kind of unusable call, each counted as `rollout/tool_errors/<kind>` (docs/agents.md)."""

MAX_CALL_CHARS = 100_000
"""A call's text longer than this is `too_large` (not parsed)."""
MAX_JSON_DEPTH = 32
"""A call's JSON nested deeper than this (arrays and objects) is `too_deep` (not parsed)."""
MAX_INT_DIGITS = 100
"""An integer in a call with more digits than this is `too_large`."""


@dataclass
class ToolCall:
    """One call as parsed: a name and its arguments, or why the text is not a call (`error`)."""
    name: str | None
    arguments: dict | None
    error: str | None = None
    """invalid_json, too_deep or too_large when the call's text could not be read; None for a
    well-formed call."""
    detail: str = ""


@dataclass
class ToolResult:
    name: str
    content: str
    """What goes back to the policy as the tool message."""
    error: str | None = None
    """A TOOL_ERROR_KINDS entry, or None for a usable result."""


HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


class CallTextError(ValueError):
    """Model-written call text outside the bounds; `kind` is its TOOL_ERROR_KINDS entry."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text`, strings skipped (without parsing it): one
    pass, linear in the text whatever its quotes (a regex over strings restarted at every unclosed
    quote: quadratic)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise CallTextError("too_large", f"an integer of {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def load_call_json(text: str):
    """JSON of model-written text within the bounds -> the object; `CallTextError` otherwise (never
    another exception: whatever the text is, it is a kind)."""
    if len(text) > MAX_CALL_CHARS:
        raise CallTextError("too_large", f"{len(text)} characters (at most {MAX_CALL_CHARS})")
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise CallTextError("too_deep", f"nested {depth} deep (at most {MAX_JSON_DEPTH})")
    try:
        return json.loads(text, parse_int=_bounded_int)
    except CallTextError:
        raise
    except json.JSONDecodeError as e:
        raise CallTextError("invalid_json", f"not JSON ({e.msg} at {e.pos})") from None
    except Exception as e:  # noqa: BLE001 - whatever else the decoder raises on odd text
        raise CallTextError("invalid_json", f"not JSON ({type(e).__name__})") from None


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>{json}</tool_call>` in `text` (an unclosed last one runs to the end)."""
    calls = []
    for match in HERMES_CALL.finditer(text):
        try:
            obj = load_call_json(match.group(1).strip())
            args = obj.get("arguments", {}) if isinstance(obj, dict) else None
            if isinstance(args, str):  # some models write the arguments as a JSON string
                args = load_call_json(args)
        except CallTextError as e:
            calls.append(ToolCall(None, None, e.kind, e.detail))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            calls.append(ToolCall(None, None, "invalid_json",
                                  'expected {"name": "<tool>", "arguments": {<name>: <value>, ...}}'))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


PARSERS = {"hermes": parse_hermes}
"""env.tool_parser -> function(text) -> list[ToolCall]."""


def tool_schema(fn) -> dict:
    """The JSON schema a chat template's `tools=` takes, from the type hints and the Google-style
    docstring (transformers' `get_json_schema`, as TRL uses it)."""
    from transformers.utils import get_json_schema
    return get_json_schema(fn)


def tool_name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def environment_tools(instance) -> dict:
    """A TRL-style environment's tools: its public bound methods except `reset` and `get_reward`."""
    return {name: member for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
            if not name.startswith("_") and name not in ("reset", "get_reward")}


@dataclass
class ToolRunnerSettings:
    timeout_s: float = 10.0
    max_output_chars: int = 4000
    max_workers: int = 8
    budget_s: float = math.inf
    """Wall time one episode may wait for its tools in all (env.tool_budget_s)."""


class PendingCall:
    """A call in flight: a ToolResult once answered (or at its deadline), else None."""

    def __init__(self, name: str, call: Call | None = None, answer: ToolResult | None = None):
        self.name, self.call, self.answer = name, call, answer

    @property
    def deadline(self) -> float:
        return self.call.deadline if self.call is not None else 0.0

    def result(self, now: float) -> ToolResult | None:
        if self.answer is not None or self.call is None:
            return self.answer
        outcome = self.call.outcome(now)
        if outcome is None:
            return None
        if outcome.kind == "timeout":
            self.answer = self._timed_out(outcome.ran)
        else:  # ToolRunner.call classifies every way the tool can end; the box is its safety net
            self.answer = outcome.value if outcome.kind == "value" else \
                ToolResult(self.name, f"error: tool {self.name!r} failed: {outcome.describe()}", outcome.kind)
        return self.answer

    def _timed_out(self, ran: bool) -> ToolResult:
        pool = self.call.pool
        what = "timed out" if ran else f"timed out waiting for a worker ({pool.hung} stuck in calls that hung)"
        return ToolResult(self.name, f"error: tool {self.name!r} {what} after {self.call.timeout_s:g}s", "timeout")


class ToolRunner:
    """Runs tool calls on a fixed pool of `max_workers` threads (`colocate.calls`) with a timeout
    and an output bound."""

    def __init__(self, settings: ToolRunnerSettings):
        self.settings = settings
        self.pool = CallPool(settings.max_workers, "tool")

    def submit(self, call: ToolCall, tools: dict, budget_left_s: float = math.inf) -> PendingCall:
        """Start one call (a malformed or unknown one is answered at once, without a worker) with a
        deadline of `timeout_s`, or what is left of the episode's tool time budget if that is less
        (none left: answered over_budget, unrun)."""
        name = call.name or "?"
        if call.error is not None:
            return PendingCall(name, answer=ToolResult(name, f"error: invalid tool call: {call.detail}", call.error))
        if call.name not in tools:
            known = ", ".join(sorted(tools)) or "none"
            return PendingCall(name, answer=ToolResult(name, f"error: unknown tool {call.name!r} (tools: {known})",
                                                       "unknown_tool"))
        if budget_left_s <= 0:
            return PendingCall(name, answer=ToolResult(name, f"error: this episode's tool time (env.tool_budget_s="
                                                       f"{self.settings.budget_s:g}s) is spent; answer without tools",
                                                       "over_budget"))
        timeout_s = min(self.settings.timeout_s, budget_left_s)
        return PendingCall(name, self.pool.submit(self.call, timeout_s, tools[call.name], call))

    def call(self, fn, call: ToolCall) -> ToolResult:
        """Run `fn` on the call's arguments in this thread -> its result or the error it becomes;
        every way the tool can end is classified here (nothing raises)."""
        try:
            inspect.signature(fn).bind(**call.arguments)
        except (TypeError, ValueError) as e:
            return ToolResult(call.name, f"error: wrong arguments for {call.name!r}: {e}", "wrong_arguments")
        outcome = run_boxed(fn, kwargs=call.arguments)
        if outcome.kind != "value":
            kind = "raised" if outcome.kind == "raised" else "base_exception"
            return ToolResult(call.name, f"error: {outcome.describe()}", kind)
        rendered = run_boxed(render, (outcome.value,))
        if rendered.kind != "value":
            return ToolResult(call.name, f"error: tool {call.name!r} returned a {type(outcome.value).__name__} that "
                              f"cannot be shown as text ({rendered.describe()})", "unrenderable")
        text, limit = rendered.value, self.settings.max_output_chars
        if len(text) > limit:
            return ToolResult(call.name, text[:limit] + " ...[output truncated]", "output_too_long")
        return ToolResult(call.name, text)

    def take_abandoned(self) -> tuple[int, int]:
        """(workers abandoned in hung calls since the last call, hung workers alive now)."""
        return self.pool.take_abandoned(), self.pool.hung

    def close(self) -> None:
        self.pool.close()


def render(out) -> str:
    """A tool's return value as the tool message's text: a string as it is, JSON for a dict or a
    list, else `str()`."""
    text = out if isinstance(out, str) else json.dumps(out) if isinstance(out, (dict, list)) else str(out)
    if not isinstance(text, str):  # a __str__ returning another type
        raise TypeError(f"str() gave a {type(text).__name__}")
    return str.__str__(text)  # a str subclass as plain text


def wait_any(pending: list[PendingCall]) -> None:
    """Block until one of `pending` is done or the earliest deadline passes."""
    wait_first([p.call for p in pending if p.call is not None and p.answer is None])
