"""One reply with tools: generate, run the calls the person approves, send the results back, until the model
answers, the round limit is reached, or the person stops it. No UI here: a `ToolSink` shows and asks.

Nothing runs unasked: a call runs only after `approve` said "once" or "always" (or its tool is in the chat's
allowed set). A call naming no known tool, a denied call, and every failure go back to the model as the call's
result, so it can answer anyway. After `max_rounds` rounds the model is asked once more without tools.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from chatapp.backend import ChatBackend
from chatapp.chat_service import generate_reply
from chatapp.chat_state import ToolRecord
from chatapp.mcp.client import McpTool, ToolOutcome
from engine.events import STOP_CANCELLED, Message, TokenEvent, TurnStats

DENIED = "The user denied this tool call; it did not run."
STOPPED = "The user stopped the reply; this call did not run."


class ToolSink(Protocol):
    """Where the loop reports (the TUI posts messages; `chatapp run` prints) and asks."""

    def token(self, event: TokenEvent, elapsed_ms: float) -> None: ...
    def round_ended(self, text: str, stats: TurnStats) -> None: ...  # the model called tools in this round
    def call_updated(self, record: ToolRecord) -> None: ...  # a call appeared, runs, or has its result
    def approve(self, record: ToolRecord) -> str: ...  # "once" | "always" | "deny" (blocks until answered)


@dataclass
class ToolChat:
    """The tools a chat offers and what the person allowed in it."""

    tools: Sequence[McpTool]
    run: Callable[[str, dict, threading.Event], ToolOutcome]  # name, arguments, stop -> outcome
    allowed: set[str] = field(default_factory=set)  # tools that run without asking ("always", or the config)
    max_rounds: int = 8


def reply_with_tools(
    backend: ChatBackend,
    messages: Sequence[Message],
    chat: ToolChat | None,
    sink: ToolSink,
    stop: threading.Event,
) -> TurnStats:
    """Run the reply on this (inference) thread; the last round's stats. Raises `ReplyError` as `generate_reply`."""
    messages = list(messages)
    specs = [t.spec() for t in chat.tools] if chat and accepts_tools(backend) else []
    rounds = 0
    while True:
        offer = specs if specs and rounds < (chat.max_rounds if chat else 0) else None
        stats = generate_reply(_Offering(backend, offer), messages, sink.token, stop)
        if not stats.tool_calls or chat is None or offer is None:
            return stats
        rounds += 1
        sink.round_ended(stats.reply, stats)
        messages.append(Message("assistant", stats.reply, stats.tool_calls))
        by_name = {t.name: t for t in chat.tools}
        for call in stats.tool_calls:
            tool = by_name.get(call.name)
            record = ToolRecord(call.id, call.name, tool.server if tool else "", call.arguments)
            record = _settle(record, tool, chat, sink, stop)
            messages.append(Message("tool", record.result, tool_call_id=call.id, name=call.name))
        if stop.is_set():
            return replace(stats, stop_reason=STOP_CANCELLED, reply="")


def accepts_tools(backend: ChatBackend) -> bool:
    """Whether `backend.stream_reply` takes `tools` (a backend from before tool calling does not)."""
    try:
        return "tools" in inspect.signature(backend.stream_reply).parameters
    except (TypeError, ValueError):
        return False


def _settle(record: ToolRecord, tool: McpTool | None, chat: ToolChat, sink: ToolSink, stop: threading.Event):
    """Ask, run and report one call; the record with its result (what the model is told)."""

    def done(status: str, result: str, ms: float = 0.0) -> ToolRecord:
        final = replace(record, status=status, result=result, ms=ms)
        sink.call_updated(final)
        return final

    if stop.is_set():
        return done("stopped", STOPPED)
    if tool is None:
        return done("error", f"Error: there is no tool named {record.name!r}.")
    try:
        arguments = json.loads(record.arguments or "{}")
        if not isinstance(arguments, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        return done("error", f"Error: the arguments are not a JSON object ({exc}).")
    if record.name not in chat.allowed:
        sink.call_updated(record)
        answer = sink.approve(record)
        if stop.is_set():
            return done("stopped", STOPPED)
        if answer == "always":
            chat.allowed.add(record.name)
        elif answer != "once":
            return done("denied", DENIED)
    sink.call_updated(replace(record, status="running"))
    start = time.perf_counter()
    outcome = chat.run(record.name, arguments, stop)
    ms = (time.perf_counter() - start) * 1000.0
    if stop.is_set() and not outcome.ok:
        return done("stopped", STOPPED, ms)
    return done("ok", outcome.text, ms) if outcome.ok else done("error", f"Error: {outcome.text}", ms)


class _Offering:
    """`backend` with this round's tools passed to `stream_reply` (`generate_reply` passes none)."""

    def __init__(self, backend: ChatBackend, tools: list | None) -> None:
        self._backend, self._tools = backend, tools

    def stream_reply(self, messages: Sequence[Message]) -> Iterator[TokenEvent | TurnStats]:
        return self._backend.stream_reply(messages, tools=self._tools) if self._tools else \
            self._backend.stream_reply(messages)  # fmt: skip

    def cancel(self) -> None:
        self._backend.cancel()
