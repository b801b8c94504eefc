"""The model picker: every model the app can load; Enter loads the highlighted one, Esc keeps the current."""

from __future__ import annotations

from collections.abc import Sequence

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, OptionList, Static
from textual.widgets.option_list import Option

from chatapp.model_choices import ModelChoice


class ModelPickerScreen(ModalScreen[str | None]):
    """Dismisses with the spec of the model to load, or None."""

    BINDINGS = [Binding("escape", "dismiss_none", "Close"), Binding("down", "focus_list", show=False)]

    def __init__(self, choices: Sequence[ModelChoice], current: str = "") -> None:
        super().__init__()
        self.choices = list(choices)
        self.current = current  # the spec or name of the model in use, marked in the list

    def compose(self) -> ComposeResult:
        with Vertical(id="models"):
            yield Input(placeholder="Filter models…", id="model-filter", compact=True)
            yield OptionList(id="model-list")
            yield Static("", id="model-empty")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#models").border_title = "Switch model"
        self._fill("")
        self.query_one("#model-list", OptionList).focus()

    def _fill(self, needle: str) -> None:
        options = self.query_one("#model-list", OptionList)
        options.clear_options()
        needle = needle.lower().strip()
        shown = [(i, c) for i, c in enumerate(self.choices) if needle in f"{c.name} {c.detail}".lower()]
        for i, c in shown:
            marker = "● " if self.current in (c.spec, c.name) else ""
            label = Content.assemble(
                (marker, "$accent"), (c.name, "bold" if c.present else "bold $text-muted"), "\n",
                (c.detail, "$text-muted"),
            )  # fmt: skip
            options.add_option(Option(label, id=str(i)))
        empty = self.query_one("#model-empty", Static)
        empty.update("Nothing matches." if not shown else "")
        empty.display = not shown
        if shown:
            options.highlighted = 0

    @on(Input.Changed, "#model-filter")
    def _filter(self, event: Input.Changed) -> None:
        self._fill(event.value)

    @on(Input.Submitted, "#model-filter")
    def _filter_submitted(self) -> None:
        self.action_focus_list()

    def action_focus_list(self) -> None:
        self.query_one("#model-list", OptionList).focus()

    @on(OptionList.OptionSelected, "#model-list")
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        if event.option.id is not None:
            self.dismiss(self.choices[int(event.option.id)].spec)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
