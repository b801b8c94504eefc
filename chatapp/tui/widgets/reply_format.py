"""The reply format dialog: `json FILE|JSON`, `grammar FILE` or `off` (Enter); Esc cancels."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from chatapp.reply_format import COMMAND, USAGE


class ReplyFormatScreen(ModalScreen[str | None]):
    """Dismisses with the text typed, or None when cancelled; `value` fills the box (to correct a mistake)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, value: str = "") -> None:
        super().__init__()
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(id="format-dialog"):
            yield Static(
                f"Every reply from the next one must match: {USAGE}. In the message box, {COMMAND} … does the same.",
                id="format-help",
            )
            yield Input(self.value, placeholder="json schema.json", id="format-value", compact=True)

    def on_mount(self) -> None:
        self.query_one("#format-dialog").border_title = "Reply format"
        self.query_one("#format-value", Input).focus()

    @on(Input.Submitted, "#format-value")
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
