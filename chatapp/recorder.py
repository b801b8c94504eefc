"""Saving the chat as it happens, through the conversation store, without ever stopping the chat.

All calls run on the UI thread (the store's SQLite connection lives there). A failing store is reported once
per distinct problem through `report` and the chat goes on unsaved; `store=None` means history is off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from chatapp.chat_state import ChatState, Turn, stats_to_dict
from chatapp.export import stored_transcript
from chatapp.store import suggest_title


class Recorder:
    def __init__(
        self,
        store: Any | None,
        report: Callable[[str], None],
        *,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        """A `chatapp.store.ConversationStore`, or None when history is off."""
        self._report = report
        self._interval_s = interval_s
        self._clock = clock
        self._last_save: dict[int, float] = {}  # msg_id -> when its text was last written
        self._reported: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # a broken history must not break the chat
            text = f"Couldn't {what}: {exc}"
            if text not in self._reported:
                self._reported.add(text)
                self._report(text)
            return None

    # ---- writing --------------------------------------------------------------------------------------

    def add_user(self, state: ChatState, turn: Turn) -> None:
        """Save a sent user message, creating the conversation on the first one."""
        if self.store is None:
            return
        if state.conv_id is None:
            state.title = state.title or suggest_title(turn.content)
            state.conv_id = self._call(
                "save the chat", self.store.create, state.title, state.model, state.system_prompt
            )
            if state.conv_id is None:
                return
        turn.msg_id = self._call("save the message", self.store.add_message, state.conv_id, "user", turn.content)

    def reply_progress(self, conv_id: int | None, turn: Turn) -> None:
        """Create the reply's row at its first token, then rewrite its text at most every `interval_s`."""
        if self.store is None or conv_id is None:
            return
        now = self._clock()
        if turn.msg_id is None:
            turn.msg_id = self._call("save the reply", self.store.add_message, conv_id, "assistant", turn.content)
            if turn.msg_id is not None:
                self._last_save[turn.msg_id] = now
        elif now - self._last_save.get(turn.msg_id, 0.0) >= self._interval_s:
            self._call("save the reply", self.store.update_message, turn.msg_id, turn.content)
            self._last_save[turn.msg_id] = now

    def reply_done(self, conv_id: int | None, turn: Turn) -> None:
        """Write the reply's final text with its stats and tokens (creating it if no token came)."""
        if self.store is None or conv_id is None:
            return
        stats = stats_to_dict(turn.stats, turn.tokens, turn.error, turn.rounds, turn.gen_ms)
        if turn.msg_id is None:
            if not turn.content and not turn.rounds:
                return  # nothing was generated: nothing to keep
            turn.msg_id = self._call(
                "save the reply", self.store.add_message, conv_id, "assistant", turn.content, stats
            )
        else:
            self._call("save the reply", self.store.update_message, turn.msg_id, turn.content, stats)
        self._last_save.pop(turn.msg_id, None)

    def branch_at(self, conv_id: int | None, msg_id: int | None) -> None:
        """The next message goes after `msg_id` (None: first), on a new branch; what followed it is kept."""
        if self.store is not None and conv_id is not None:
            self._call("update the saved chat", self.store.branch_at, conv_id, msg_id)

    def switch_branch(self, conv_id: int, msg_id: int) -> bool:
        """Make the branch through `msg_id` the one on screen; False if the store could not."""
        if self.store is None:
            return False
        return self._call("switch branches", self.store.switch_branch, conv_id, msg_id) is not None

    def siblings(self, msg_id: int | None) -> list[int]:
        """`msg_id` and its other versions (other branches from the same point), oldest first."""
        if self.store is None or msg_id is None:
            return []
        return self._call("read the branches", self.store.siblings, msg_id) or []

    def delete(self, conv_id: int) -> None:
        if self.store is not None:
            self._call("delete the chat", self.store.delete, conv_id)

    def set_system_prompt(self, conv_id: int | None, text: str) -> None:
        if self.store is not None and conv_id is not None:
            self._call("save the system prompt", self.store.set_system_prompt, conv_id, text)

    # ---- reading --------------------------------------------------------------------------------------

    def conversations(self, limit: int = 200) -> list[Any]:
        if self.store is None:
            return []
        return self._call("list saved chats", self.store.list, limit) or []

    def search(self, text: str) -> list[Any]:
        """Messages of every saved chat that hold all of `text`'s words (store.SearchHit)."""
        if self.store is None:
            return []
        return self._call("search the chats", self.store.search, text) or []

    def load(self, conv_id: int) -> Any | None:
        if self.store is None:
            return None
        return self._call("open the chat", self.store.load, conv_id)

    def export_markdown(self, conv_id: int) -> str | None:
        """The saved chat as Markdown, all its branches included (None: no store, or it failed and said so)."""
        if self.store is None:
            return None
        return self._call("export the chat", stored_transcript, self.store, conv_id)
