"""The system prompt editor: a modal TextArea; ctrl+s saves, Esc cancels."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static, TextArea


class SystemPromptScreen(ModalScreen[str | None]):
    """Dismisses with the new system prompt, or None when cancelled."""

    BINDINGS = [
        Binding("ctrl+s", "save", "Save", priority=True),
        Binding("escape", "cancel", "Cancel"),
    ]

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(id="system-dialog"):
            yield Static(
                "Sent before the conversation on every turn. Applies from the next reply and to new chats.",
                id="system-help",
            )
            yield TextArea(self.text, id="system-text", soft_wrap=True, tab_behavior="focus")
            with Horizontal(id="system-buttons"):
                yield Button("Save  ctrl+s", id="system-save", variant="primary", compact=True)
                yield Button("Clear", id="system-clear", compact=True)
                yield Button("Cancel  esc", id="system-cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one("#system-dialog").border_title = "System prompt"
        area = self.query_one("#system-text", TextArea)
        area.focus()
        area.move_cursor(area.document.end)

    def action_save(self) -> None:
        self.dismiss(self.query_one("#system-text", TextArea).text.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#system-save")
    def _save(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#system-clear")
    def _clear(self) -> None:
        self.query_one("#system-text", TextArea).clear()

    @on(Button.Pressed, "#system-cancel")
    def _cancel(self) -> None:
        self.action_cancel()
