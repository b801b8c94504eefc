"""The saved-chats screen: filter by title or model and search every message, resume a chat or jump to a found
message (Enter), export (x), delete (d twice)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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

from chatapp.kv_cache import kv_cache_summary
from chatapp.store import SNIPPET_MARKS

Choice = tuple[int, int | None]
"""What the screen dismisses with: (conversation id, message id to jump to, or None for the chat's end)."""


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


def snippet_content(snippet: str) -> Content:
    """A search snippet with its matched words (between SNIPPET_MARKS) highlighted, on one line."""
    start, end = SNIPPET_MARKS
    parts: list[tuple[str, str] | str] = []
    for i, piece in enumerate(" ".join(snippet.split()).split(start)):
        word, _, rest = piece.partition(end) if i else ("", "", piece)
        parts += [(word, "bold $accent"), rest]
    return Content.assemble(*parts)


class ConversationsScreen(ModalScreen[Choice | None]):
    """Dismisses with the chat to resume (and the message to show), or None."""

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

    def __init__(
        self,
        summaries: Sequence[Any],
        current: int | None = None,
        search: Callable[[str], Sequence[Any]] | None = None,
    ) -> None:
        super().__init__()
        self.summaries = list(summaries)
        self.current = current
        self.search = search  # text -> store.SearchHit list; None: filter titles only
        self._armed_delete: int | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations"):
            yield Input(placeholder="Filter by title or model, search every message…", id="conv-filter", compact=True)
            yield OptionList(id="conv-list")
            yield Static("", id="conv-empty")
        yield Footer()

    def on_mount(self) -> None:
        box = self.query_one("#conversations")
        box.border_title = "Saved chats"
        box.border_subtitle = kv_cache_summary()  # what resuming without prefill costs on disk
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
        hits = list(self.search(needle)) if self.search is not None and needle else []
        if hits:
            options.add_option(Option(Content.styled(f"In messages ({len(hits)})", "$text-muted"), disabled=True))
        for h in hits:
            label = Content.assemble(
                (h.title or "Untitled", "bold"), (f"  {h.role} · {when(h.updated)}", "$text-muted"), "\n",
                snippet_content(h.snippet),
            )  # fmt: skip
            options.add_option(Option(label, id=f"{h.conv_id}:{h.msg_id}"))
        empty = self.query_one("#conv-empty", Static)
        found = bool(shown or hits)
        empty.update("No saved chats yet." if not self.summaries else "Nothing matches." if not found else "")
        empty.display = not found
        if found:
            options.highlighted = 0 if shown else 1

    @on(Input.Changed, "#conv-filter")
    def _filter(self, event: Input.Changed) -> None:
        self._fill(event.value)

    @on(Input.Submitted, "#conv-filter")
    def _filter_submitted(self) -> None:
        self.action_focus_list()

    def action_focus_list(self) -> None:
        self.query_one("#conv-list", OptionList).focus()

    @staticmethod
    def _choice(option_id: str | None) -> Choice | None:
        if option_id is None:
            return None
        conv, _, msg = option_id.partition(":")
        return int(conv), int(msg) if msg else None

    def _selected(self) -> int | None:
        options = self.query_one("#conv-list", OptionList)
        if options.highlighted is None:
            return None
        choice = self._choice(options.get_option_at_index(options.highlighted).id)
        return choice[0] if choice is not None else None

    @on(OptionList.OptionSelected, "#conv-list")
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        if (choice := self._choice(event.option.id)) is not None:
            self.dismiss(choice)

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
        self._fill(self.query_one("#conv-filter", Input).value)  # its messages leave the search results too
