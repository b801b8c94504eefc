"""The message box: multi-line, Enter sends, shift+enter / ctrl+j / alt+enter add a line, up/down recall."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


class PromptInput(TextArea):
    """A TextArea that sends on Enter and keeps a history of what was sent."""

    class Submitted(Message):
        """The user pressed Enter on a non-blank message."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(
            id=id,
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
            placeholder="Message…   Enter sends · ctrl+j new line · ↑ recalls",
        )
        self.sent: list[str] = []
        """Messages sent (and recalled from resumed chats), oldest first."""
        self._recall_index: int | None = None  # None: editing the draft, else an index into history
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self.text))
        elif event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.replace("\n", *self.selection)

    def remember(self, text: str) -> None:
        """Add a sent message to the history and reset browsing."""
        if text.strip() and (not self.sent or self.sent[-1] != text):
            self.sent.append(text)
        self._recall_index = None
        self._draft = ""

    def set_text(self, text: str) -> None:
        """Replace the content and put the cursor at its end."""
        self.load_text(text)
        self.move_cursor(self.document.end)

    # ---- history on up/down at the first/last line ------------------------------------------------------

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.cursor_location[0] == 0 and self.selection.is_empty and self.sent:
            if self._recall_index is None:
                self._draft = self.text
                self._recall_index = len(self.sent) - 1
            elif self._recall_index > 0:
                self._recall_index -= 1
            else:
                return
            self.set_text(self.sent[self._recall_index])
            return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if not select and self._recall_index is not None and self.cursor_location[0] == last_row:
            if self._recall_index < len(self.sent) - 1:
                self._recall_index += 1
                self.set_text(self.sent[self._recall_index])
            else:
                self._recall_index = None
                self.set_text(self._draft)
            return
        super().action_cursor_down(select)
