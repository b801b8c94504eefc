"""What the background threads run. Nothing here knows about widgets: results leave as posted messages.

`ChatApp` wraps these in its `@work(thread=True)` methods; keeping the bodies here, as plain functions of a
`post` callable, lets tests run them without an App.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from textual.message import Message as UIMessage

from chatapp.backend import ChatBackend
from chatapp.chat_service import ReplyError, generate_reply
from chatapp.chat_state import ToolRecord
from chatapp.errors import describe_error
from chatapp.mcp.loop import ToolChat, reply_with_tools
from chatapp.tui.messages import (
    ApprovalNeeded,
    ModelFailed,
    ModelLoading,
    ModelReady,
    ReplyFailed,
    ReplyFinished,
    TokenReceived,
    ToolCallUpdated,
    ToolRoundEnded,
)
from engine.events import Message, TokenEvent, TurnStats

Post = Callable[[UIMessage], object]
BackendFactory = Callable[[Callable[[str], None]], ChatBackend]


def stream_turn(
    backend: ChatBackend,
    messages: Sequence[Message],
    turn: int,
    post: Post,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Generate one reply, posting TokenReceived per token and exactly one ReplyFinished or ReplyFailed."""
    try:
        stats = generate_reply(
            backend, messages, lambda event, ms: post(TokenReceived(turn, event, ms)), stop, clock
        )
    except ReplyError as exc:
        post(ReplyFailed(turn, str(exc)))
    else:
        post(ReplyFinished(turn, stats))


class PostingSink:
    """The tool loop's reports as posted messages; `approve` waits for the UI's answer (or for Esc/quit)."""

    def __init__(self, turn: int, post: Post, stop: threading.Event) -> None:
        self.turn, self.post, self.stop = turn, post, stop

    def token(self, event: TokenEvent, elapsed_ms: float) -> None:
        self.post(TokenReceived(self.turn, event, elapsed_ms))

    def round_ended(self, text: str, stats: TurnStats) -> None:
        self.post(ToolRoundEnded(self.turn, text, stats))

    def call_updated(self, record: ToolRecord) -> None:
        self.post(ToolCallUpdated(self.turn, record))

    def approve(self, record: ToolRecord) -> str:
        answer: Future[str] = Future()
        self.post(ApprovalNeeded(self.turn, record, answer))
        while not self.stop.is_set():
            try:
                return answer.result(timeout=0.05)
            except FutureTimeout:
                continue
        return "deny"


def stream_tool_turn(
    backend: ChatBackend,
    messages: Sequence[Message],
    turn: int,
    post: Post,
    stop: threading.Event,
    tools: ToolChat | None,
) -> None:
    """Like `stream_turn`, with the tool loop: calls, approvals and rounds are posted too."""
    try:
        stats = reply_with_tools(backend, messages, tools, PostingSink(turn, post, stop), stop)
    except ReplyError as exc:
        post(ReplyFailed(turn, str(exc)))
    else:
        post(ReplyFinished(turn, stats))


def load_backend(factory: BackendFactory, post: Post) -> None:
    """Build the backend (load the model), posting progress lines, then ModelReady or ModelFailed."""
    try:

        def say(line: str) -> None:
            post(ModelLoading(str(line)))

        backend = factory(say)
    except Exception as exc:  # a failed load leaves the app usable
        post(ModelFailed(describe_error(exc)))
    else:
        post(ModelReady(backend))
