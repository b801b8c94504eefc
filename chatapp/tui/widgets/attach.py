"""The attach dialog: the path of a text file to put into the message box (Enter), Esc cancels."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from chatapp.attachments import COMMAND, MAX_BYTES


class AttachScreen(ModalScreen[str | None]):
    """Dismisses with the path typed, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="attach-dialog"):
            yield Static(
                f"A text file of up to {MAX_BYTES // 1024} KB goes into the message as a code block under its name."
                f" In the message box, {COMMAND} PATH does the same.",
                id="attach-help",
            )
            yield Input(placeholder="path/to/file (~ and relative paths work)", id="attach-path", compact=True)

    def on_mount(self) -> None:
        self.query_one("#attach-dialog").border_title = "Attach a file"
        self.query_one("#attach-path", Input).focus()

    @on(Input.Submitted, "#attach-path")
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
