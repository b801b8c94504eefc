"""The saved-chats screen: filter, resume (Enter), export (x), delete (d twice)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, OptionList, Static
from textual.widgets.option_list import Option


def when(ts: float, now: float | None = None) -> str:
    """A short human time: 14:03 today, yesterday 09:12, 3 Mar, 3 Mar 2023."""
    now = time.time() if now is None else now
    t, n = time.localtime(ts), time.localtime(now)
    if (t.tm_year, t.tm_yday) == (n.tm_year, n.tm_yday):
        return time.strftime("today %H:%M", t)
    if now - ts < 2 * 86400 and (n.tm_yday - t.tm_yday) % 366 == 1:
        return time.strftime("yesterday %H:%M", t)
    day = f"{t.tm_mday} {time.strftime('%b', t)}"
    return day if t.tm_year == n.tm_year else f"{day} {t.tm_year}"


class ConversationsScreen(ModalScreen[int | None]):
    """Dismisses with the id of the chat to resume, or None."""

    BINDINGS = [
        Binding("escape", "dismiss_none", "Close"),
        Binding("x", "export", "Export"),
        Binding("d,delete", "delete", "Delete"),
        Binding("down", "focus_list", show=False),
    ]

    class Export(Message):
        def __init__(self, conv_id: int) -> None:
            super().__init__()
            self.conv_id = conv_id

    class Delete(Message):
        def __init__(self, conv_id: int) -> None:
            super().__init__()
            self.conv_id = conv_id

    def __init__(self, summaries: Sequence[Any], current: int | None = None) -> None:
        super().__init__()
        self.summaries = list(summaries)
        self.current = current
        self._armed_delete: int | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations"):
            yield Input(placeholder="Filter by title or model…", id="conv-filter", compact=True)
            yield OptionList(id="conv-list")
            yield Static("", id="conv-empty")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#conversations").border_title = "Saved chats"
        self._fill("")
        self.query_one("#conv-list", OptionList).focus()

    def _fill(self, needle: str) -> None:
        options = self.query_one("#conv-list", OptionList)
        options.clear_options()
        needle = needle.lower().strip()
        shown = [s for s in self.summaries if needle in f"{s.title} {s.model}".lower()]
        for s in shown:
            marker = "● " if s.id == self.current else ""
            label = Content.assemble(
                (marker, "$accent"),
                (s.title or "Untitled", "bold"),
                "\n",
                (f"{s.model} · {s.n_messages} messages · {when(s.updated)}", "$text-muted"),
            )
            options.add_option(Option(label, id=str(s.id)))
        empty = self.query_one("#conv-empty", Static)
        empty.update("No saved chats yet." if not self.summaries else "Nothing matches." if not shown else "")
        empty.display = not shown
        if shown:
            options.highlighted = 0

    @on(Input.Changed, "#conv-filter")
    def _filter(self, event: Input.Changed) -> None:
        self._fill(event.value)

    @on(Input.Submitted, "#conv-filter")
    def _filter_submitted(self) -> None:
        self.action_focus_list()

    def action_focus_list(self) -> None:
        self.query_one("#conv-list", OptionList).focus()

    def _selected(self) -> int | None:
        options = self.query_one("#conv-list", OptionList)
        if options.highlighted is None:
            return None
        option_id = options.get_option_at_index(options.highlighted).id
        return int(option_id) if option_id is not None else None

    @on(OptionList.OptionSelected, "#conv-list")
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        if event.option.id is not None:
            self.dismiss(int(event.option.id))

    def action_dismiss_none(self) -> None:
        self.dismiss(None)

    def action_export(self) -> None:
        if (conv_id := self._selected()) is not None:
            self.app.post_message(self.Export(conv_id))

    def action_delete(self) -> None:
        conv_id = self._selected()
        if conv_id is None:
            return
        if self._armed_delete != conv_id:
            self._armed_delete = conv_id
            self.notify("Press d again to delete this chat", severity="warning")
            return
        self._armed_delete = None
        self.app.post_message(self.Delete(conv_id))
        self.summaries = [s for s in self.summaries if s.id != conv_id]
        self._fill(self.query_one("#conv-filter", Input).value)
