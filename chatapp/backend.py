"""The one narrow interface between the app and an inference engine.

The TUI talks only to a `ChatBackend`. The real one wraps `engine.chat.ChatSession`; tests use a scripted fake.
`stream_reply` is called from the single inference worker thread; `settings` and `cancel()` may be used from
the UI thread at any moment.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from engine.events import Message, TokenEvent, TurnStats
from engine.sampling import SamplingSettings


class ChatBackend(Protocol):
    model_name: str  # what the status line shows
    n_ctx: int  # context size in tokens

    settings: SamplingSettings
    """Replaced (never mutated) by the UI; read by the worker before every sampled token."""

    def stream_reply(self, messages: Sequence[Message]) -> Iterator[TokenEvent | TurnStats]:
        """Generate the assistant's reply to `messages` (system?, user, assistant, ..., user).

        Yields one TokenEvent per token, then exactly one TurnStats. Reuses the KV cache for the longest
        common prefix with the previous call, so regenerate and edit cost only the changed tail.
        """
        ...

    def cancel(self) -> None:
        """Ask the running `stream_reply` to stop after the current token (stop_reason 'cancelled')."""
        ...

    def warnings(self) -> list[str]:
        """One-time warnings for the user (e.g. the chat template fell back to ChatML)."""
        ...
