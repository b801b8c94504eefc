"""The one narrow interface between the app and an inference engine.

The TUI talks only to a `ChatBackend`. The local one is `engine.chat.ChatSession`; `chatapp.remote.RemoteBackend`
is a model on an OpenAI-compatible server; tests use a scripted fake. `stream_reply` is called from the single
inference worker thread; `settings` and `cancel()` may be used from the UI thread at any moment.

A remote backend's `remote` is a `chatapp.remote.RemoteInfo` (host, server, which settings it honours), which
the status line and the sampling panel show; a local one's is None. A remote backend's `n_ctx` is 0 when the
server does not say, its token events have `token_id` -1 (servers send text, not ids) and `prob` -1 when the
server sent no logprobs, and a new `settings` applies from the next reply: a request in flight keeps the
settings it was sent with.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from engine.events import Message, TokenEvent, ToolSpec, TurnStats
from engine.sampling import SamplingSettings

if TYPE_CHECKING:
    from .remote import RemoteInfo


class ChatBackend(Protocol):
    @property
    def model_name(self) -> str:
        """What the status line shows."""
        ...

    @property
    def n_ctx(self) -> int:
        """Context size in tokens."""
        ...

    settings: SamplingSettings
    """Replaced (never mutated) by the UI; read by the worker before every sampled token."""

    @property
    def remote(self) -> RemoteInfo | None:
        """The server a remote model runs on; None for a model in this process."""
        ...

    def stream_reply(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None = None
    ) -> Iterator[TokenEvent | TurnStats]:
        """Generate the assistant's reply to `messages` (system?, user, assistant, ..., user, or tool results).

        With `tools`, the model may answer with calls: they come back parsed in `TurnStats.tool_calls`, and the
        caller runs them and sends their results as "tool" messages in the next call.

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
