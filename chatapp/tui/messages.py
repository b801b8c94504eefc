"""Every message a background worker posts to the UI.

Workers run in threads and never touch widgets: they post one of these and the App's handlers do the rest
on the UI thread. Each reply message carries the `turn` number it belongs to, so a message from a reply the
user has already left behind (new chat, resumed chat) is recognised and only saved, never shown.
"""

from __future__ import annotations

from concurrent.futures import Future

from textual.message import Message

from chatapp.backend import ChatBackend
from chatapp.chat_state import ToolRecord
from engine.events import TokenEvent, TurnStats


class TokenReceived(Message):
    """The engine produced one token of the reply in progress."""

    def __init__(self, turn: int, event: TokenEvent, elapsed_ms: float) -> None:
        super().__init__()
        self.turn = turn
        self.event = event
        self.elapsed_ms = elapsed_ms
        """Wall time from the `stream_reply` call to this token."""


class ReplyFinished(Message):
    """The reply ended normally (EOS, length, stop string, cancel, full context); the final event."""

    def __init__(self, turn: int, stats: TurnStats) -> None:
        super().__init__()
        self.turn = turn
        self.stats = stats


class ReplyFailed(Message):
    """The engine raised while generating; `error` is a one-line description fit for the user."""

    def __init__(self, turn: int, error: str) -> None:
        super().__init__()
        self.turn = turn
        self.error = error


class ModelLoading(Message):
    """A progress line from the model loader ("loading weights 40%")."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class ModelReady(Message):
    """The model is loaded; `backend` is ready for `stream_reply`."""

    def __init__(self, backend: ChatBackend) -> None:
        super().__init__()
        self.backend = backend


class ModelFailed(Message):
    """The model could not be loaded; the app carries on without one (saved chats stay browsable)."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class ToolRoundEnded(Message):
    """The model asked for tools: `text` is what it said before its calls; its calls follow."""

    def __init__(self, turn: int, text: str, stats: TurnStats) -> None:
        super().__init__()
        self.turn = turn
        self.text = text
        self.stats = stats


class ToolCallUpdated(Message):
    """A call appeared (waiting for approval), runs, or has its result."""

    def __init__(self, turn: int, record: ToolRecord) -> None:
        super().__init__()
        self.turn = turn
        self.record = record


class ApprovalNeeded(Message):
    """A call waits for the person: set `answer`'s result to "once", "always" or "deny"."""

    def __init__(self, turn: int, record: ToolRecord, answer: Future[str]) -> None:
        super().__init__()
        self.turn = turn
        self.record = record
        self.answer = answer


class ToolsStarted(Message):
    """The MCP servers were started; `failures`: one line per server that did not start."""

    def __init__(self, failures: list[str]) -> None:
        super().__init__()
        self.failures = failures
