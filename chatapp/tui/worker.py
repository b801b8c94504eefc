"""What the background threads run. Nothing here knows about widgets: results leave as posted messages.

`ChatApp` wraps these in its `@work(thread=True)` methods; keeping the bodies here, as plain functions of a
`post` callable, lets tests run them without an App.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from textual.message import Message as UIMessage

from chatapp.backend import ChatBackend
from chatapp.chat_service import ReplyError, generate_reply
from chatapp.errors import describe_error
from chatapp.tui.messages import (
    ModelFailed,
    ModelLoading,
    ModelReady,
    ReplyFailed,
    ReplyFinished,
    TokenReceived,
)
from engine.events import Message

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


def load_backend(factory: BackendFactory, post: Post) -> None:
    """Build the backend (load the model), posting progress lines, then ModelReady or ModelFailed."""
    try:
        backend = factory(lambda line: post(ModelLoading(str(line))))
    except Exception as exc:  # a failed load leaves the app usable
        post(ModelFailed(describe_error(exc)))
    else:
        post(ModelReady(backend))
