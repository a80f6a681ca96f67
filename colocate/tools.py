"""Tool calls of an agent: parsing them out of sampled text, running them off the rollout loop.

Tool arguments come from sampled text, so they are untrusted input: a call that cannot be used
(unknown tool, text that is not the call format's JSON, arguments the function does not take, a
function that raises or outlasts `timeout_s`, output longer than `max_output_chars`) becomes a tool
message the policy reads on its next turn, with its kind counted (`rollout/tool_errors/<kind>`);
nothing here raises into the rollout.

Parsers are chosen by name (`env.tool_parser`): `hermes` is the Hermes / Qwen format,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.

Tools run in daemon threads (at most `max_workers` at once), so a hung tool never blocks the engine
feeding nor the process's exit; its thread cannot be killed, only abandoned, which is why a tool
that runs code should run it in a subprocess with limits (docs/agents.md).
"""
from __future__ import annotations

import inspect
import json
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

TOOL_ERROR_KINDS = ("unknown_tool", "invalid_json", "wrong_arguments", "raised", "timeout", "output_too_long")
"""Every kind of unusable call, each counted as `rollout/tool_errors/<kind>`."""


@dataclass
class ToolCall:
    """One call as parsed: a name and its arguments, or why the text is not a call (`error`)."""
    name: str | None
    arguments: dict | None
    error: str | None = None
    """invalid_json when the call's text could not be read; None for a well-formed call."""
    detail: str = ""


@dataclass
class ToolResult:
    name: str
    content: str
    """What goes back to the policy as the tool message."""
    error: str | None = None
    """A TOOL_ERROR_KINDS entry, or None for a usable result."""


HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>{json}</tool_call>` in `text` (an unclosed last one runs to the end)."""
    calls = []
    for match in HERMES_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1).strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, None, "invalid_json", f"not JSON ({e.msg} at {e.pos})"))
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
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


class PendingCall:
    """A call in flight: its future and when it started (the timeout is measured from submission,
    so a call queued behind hung ones times out too)."""

    def __init__(self, name: str, future: Future, deadline: float):
        self.name, self.future, self.deadline = name, future, deadline

    def result(self, now: float) -> ToolResult | None:
        """The result once done, a timeout once past the deadline, else None."""
        if self.future.done():
            return self.future.result()
        if now >= self.deadline:
            return ToolResult(self.name, f"error: tool {self.name!r} timed out", "timeout")
        return None


class ToolRunner:
    """Runs tool calls in daemon threads with a timeout and an output bound."""

    def __init__(self, settings: ToolRunnerSettings):
        self.settings = settings
        self._slots = threading.BoundedSemaphore(max(1, settings.max_workers))

    def submit(self, call: ToolCall, tools: dict) -> PendingCall:
        """Start one call (a malformed or unknown one is answered at once, without a thread)."""
        now = time.monotonic()
        future: Future = Future()
        name = call.name or "?"
        pending = PendingCall(name, future, now + self.settings.timeout_s)
        if call.error is not None:
            future.set_result(ToolResult(name, f"error: invalid tool call: {call.detail}", call.error))
        elif call.name not in tools:
            known = ", ".join(sorted(tools)) or "none"
            future.set_result(ToolResult(name, f"error: unknown tool {call.name!r} (tools: {known})", "unknown_tool"))
        else:
            threading.Thread(target=self._run, args=(tools[call.name], call, future), daemon=True,
                             name=f"colocate-tool-{name}").start()
        return pending

    def _run(self, fn, call: ToolCall, future: Future) -> None:
        with self._slots:
            future.set_result(self.call(fn, call))

    def call(self, fn, call: ToolCall) -> ToolResult:
        """Run `fn` on the call's arguments in this thread -> its result or the error it becomes."""
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return ToolResult(call.name, f"error: wrong arguments for {call.name!r}: {e}", "wrong_arguments")
        try:
            out = fn(**call.arguments)
        except Exception as e:  # the tool's own failure is an observation, not a crash
            return ToolResult(call.name, f"error: {type(e).__name__}: {e}", "raised")
        text = out if isinstance(out, str) else json.dumps(out) if isinstance(out, (dict, list)) else str(out)
        limit = self.settings.max_output_chars
        if len(text) > limit:
            return ToolResult(call.name, text[:limit] + " ...[output truncated]", "output_too_long")
        return ToolResult(call.name, text)


def wait_any(pending: list[PendingCall]) -> None:
    """Block until one of `pending` is done or the earliest deadline passes."""
    if not pending:
        return
    timeout = max(0.0, min(p.deadline for p in pending) - time.monotonic())
    wait([p.future for p in pending], timeout=timeout, return_when=FIRST_COMPLETED)
