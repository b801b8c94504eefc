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
from chatapp.tui.messages import (
    ModelFailed,
    ModelLoading,
    ModelReady,
    ReplyFailed,
    ReplyFinished,
    TokenReceived,
)
from engine.errors import EngineError
from engine.events import Message, TokenEvent, TurnStats

Post = Callable[[UIMessage], object]
BackendFactory = Callable[[Callable[[str], None]], ChatBackend]


def describe_error(exc: BaseException) -> str:
    """One line for the user. Engine errors already name the thing at fault; others get their type."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, EngineError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def stream_turn(
    backend: ChatBackend,
    messages: Sequence[Message],
    turn: int,
    post: Post,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Generate one reply, posting TokenReceived per token and exactly one ReplyFinished or ReplyFailed.

    The UI calls `backend.cancel()` itself and sets `stop`; should that cancel have landed before
    `stream_reply` started (and been forgotten by it), the next token repeats it from here.
    """
    start = clock()
    repeated = False
    try:
        for event in backend.stream_reply(messages):
            if isinstance(event, TokenEvent):
                post(TokenReceived(turn, event, (clock() - start) * 1000.0))
                if stop is not None and stop.is_set() and not repeated:
                    repeated = True
                    backend.cancel()
            elif isinstance(event, TurnStats):
                post(ReplyFinished(turn, event))
                return
    except Exception as exc:  # any engine failure becomes a message, never a traceback
        post(ReplyFailed(turn, describe_error(exc)))
        return
    post(ReplyFailed(turn, "the engine ended the reply without its statistics"))


def load_backend(factory: BackendFactory, post: Post) -> None:
    """Build the backend (load the model), posting progress lines, then ModelReady or ModelFailed."""
    try:
        backend = factory(lambda line: post(ModelLoading(str(line))))
    except Exception as exc:  # a failed load leaves the app usable
        post(ModelFailed(describe_error(exc)))
    else:
        post(ModelReady(backend))
