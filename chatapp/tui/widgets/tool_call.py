"""Tools in the chat: a call's block (tool, server, arguments, result), the approval prompt under it, and the
list of tools where each can be turned off for the chat."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import SelectionList, Static
from textual.widgets.selection_list import Selection

from chatapp.chat_state import ToolRecord
from chatapp.export import pretty_arguments

RESULT_LINES = 6  # a longer result shows this many lines until expanded (Enter or click)

STATUS = {
    "asking": ("waiting for your approval", "$warning"),
    "running": ("running…", "$accent"),
    "ok": ("", ""),
    "denied": ("denied", "$warning"),
    "error": ("failed", "$error"),
    "stopped": ("stopped", "$warning"),
}


class ToolCallBlock(Static, can_focus=True):
    """One call: `tool · server` on the border, the arguments, then the result (collapsed past a few lines)."""

    BINDINGS = [Binding("enter", "expand", "Expand result")]

    def __init__(self, record: ToolRecord) -> None:
        super().__init__("", markup=False)
        self.expanded = False
        self.set_record(record)

    def set_record(self, record: ToolRecord) -> None:
        self.record = record
        self.border_title = f"⚙ {record.name}" + (f" · {record.server}" if record.server else "")
        self.update(self._describe())

    def _describe(self) -> Content:
        record = self.record
        parts: list[Content] = [Content.styled(pretty_arguments(record.arguments), "$text-muted")]
        label, style = STATUS.get(record.status, (record.status, ""))
        if record.status in ("asking", "running"):
            parts.append(Content.styled(label, f"italic {style}"))
        elif record.status == "ok":
            lines = record.result.splitlines() or [""]
            shown = lines if self.expanded else lines[:RESULT_LINES]
            parts.append(Content.styled(f"→ result ({record.ms:.0f} ms)", "bold"))
            parts.append(Content("\n".join(shown)))
            if len(lines) > len(shown):
                parts.append(Content.styled(f"… {len(lines) - len(shown)} more lines (Enter shows all)", "italic"))
        else:
            one = " ".join(record.result.split())
            parts.append(Content.styled(f"⚠ {label}: {one}", style))
        self.set_class(record.status in ("error", "denied", "stopped"), "-failed")
        return Content("\n").join(parts)

    def action_expand(self) -> None:
        """Show the whole result, or the first lines again (DOMNode's `action_toggle` flips an attribute)."""
        self.expanded = not self.expanded
        self.update(self._describe())

    def on_click(self) -> None:
        self.action_expand()


class ApprovalPrompt(Static, can_focus=True):
    """Asks before a call runs: y once, a always (this tool, this chat), n or Esc denies."""

    BINDINGS = [
        Binding("y", "answer('once')", "Allow once"),
        Binding("a", "answer('always')", "Always (this chat)"),
        Binding("n", "answer('deny')", "Deny"),
        Binding("escape", "answer('deny')", "Deny", show=False),
    ]

    class Answered(Message):
        def __init__(self, prompt: ApprovalPrompt, answer: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.answer = answer

    def __init__(self, record: ToolRecord) -> None:
        super().__init__("", markup=False)
        self.record = record
        self.border_title = "Run this tool?"
        self.update(Content.assemble(
            "Run ", (record.name, "bold"), f" on {record.server or '?'}?   ",
            ("y", "bold $accent"), " once · ", ("a", "bold $accent"), " always in this chat · ",
            ("n", "bold $accent"), "/", ("Esc", "bold $accent"), " deny",
        ))  # fmt: skip

    def action_answer(self, answer: str) -> None:
        self.post_message(self.Answered(self, answer))


class ToolsScreen(ModalScreen[set[str] | None]):
    """Every tool (name, server, description); the ticked ones are offered to the model in this chat."""

    BINDINGS = [Binding("escape", "done", "Close")]

    def __init__(self, tools: list, tools_off: set[str], servers: list[str]) -> None:
        super().__init__()
        self.tools = tools
        self.tools_off = tools_off  # not Widget.disabled, which would disable the screen itself
        self.servers = servers

    def compose(self) -> ComposeResult:
        with Vertical(id="tools-dialog"):
            yield Static(Content.assemble(("Tools", "bold"), "  space turns one on or off for this chat · Esc closes"))
            yield Static(Content("\n".join(self.servers) or "No MCP servers configured."), classes="servers")
            yield SelectionList[str](
                *[
                    Selection(f"{t.name} · {t.server} — {t.description.splitlines()[0] if t.description else ''}",
                              t.name, t.name not in self.tools_off)  # fmt: skip
                    for t in self.tools
                ]
            )

    def action_done(self) -> None:
        chosen = set(self.query_one(SelectionList).selected)
        self.dismiss({t.name for t in self.tools} - chosen)
