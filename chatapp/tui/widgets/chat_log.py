"""The message list: the user's messages, the assistant's replies (streamed as Markdown) and their stats."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from chatapp.chat_state import ChatState, ToolRecord, Turn, code_blocks, stats_line, tools_line
from chatapp.tui.thinking import split_thinking, thinking_token_count
from chatapp.tui.widgets.tool_call import ApprovalPrompt, ToolCallBlock

# On a focused message: its other versions (branches), editing it, a new reply from it.
BRANCH_KEYS = [
    Binding("left", "app.branch(-1)", "Prev version", show=False),
    Binding("right", "app.branch(1)", "Next version", show=False),
]


class UserMessage(Static, can_focus=True):
    """One message from the user, shown as typed (no Markdown, no markup)."""

    BINDINGS = [*BRANCH_KEYS, Binding("e", "app.edit_last", "Edit"), Binding("r", "app.regenerate", "Reply again")]

    def __init__(self, turn: Turn) -> None:
        super().__init__(Content(turn.content), markup=False)
        self.turn = turn
        self.border_title = "You"


class AssistantMessage(Vertical, can_focus=True):
    """One reply: its thinking (collapsed, when the model thinks aloud), a Markdown body streamed while it is
    generated, and its stats line underneath."""

    BINDINGS = [
        Binding("i", "app.inspect", "Inspect"),
        Binding("c", "app.copy_reply", "Copy"),
        Binding("b", "copy_next_block", "Copy code"),
        Binding("t", "toggle_thinking", "Thinking"),
        Binding("r", "app.regenerate", "Regenerate"),
        *BRANCH_KEYS,
    ]

    def __init__(self, turn: Turn, model_name: str) -> None:
        super().__init__()
        self.turn = turn
        self.border_title = model_name
        self._stream: MarkdownStream | None = None
        self._pending = ""  # streamed text not shown yet (`queue`)
        self._next_block = 0
        self._raw = ""  # the reply's text so far, while streaming
        self._answer_sent = ""  # what of the answer the body's stream has been given

    def compose(self) -> ComposeResult:
        split = split_thinking(self.turn.content)
        with Collapsible(title="Thinking", collapsed=True, classes="thinking"):
            yield Static(Content(split.thinking), classes="thinking-text", markup=False)
        with Vertical(classes="tools"):
            for r in self.turn.rounds:
                yield from (ToolCallBlock(c) for c in r.calls)
        yield Markdown(split.answer, classes="body")
        yield Static("", classes="meta", markup=False)

    def on_mount(self) -> None:
        self._show_thinking(split_thinking(self.turn.content))
        self.show_outcome()

    @property
    def body(self) -> Markdown:
        return self.query_one(".body", Markdown)

    @property
    def thinking(self) -> Collapsible:
        return self.query_one(".thinking", Collapsible)

    def _show_thinking(self, split, streaming: bool = False) -> None:
        box = self.thinking
        box.display = bool(split.thinking) or split.open
        if box.display:
            box.query_one(".thinking-text", Static).update(Content(split.thinking))
            words = len(split.thinking.split())
            box.title = f"Thinking… ({words} words)" if streaming and split.open else f"Thought ({words} words)"

    def action_toggle_thinking(self) -> None:
        if self.thinking.display:
            self.thinking.collapsed = not self.thinking.collapsed

    # ---- tools -------------------------------------------------------------------------------------

    def call_block(self, call_id: str) -> ToolCallBlock | None:
        return next((b for b in self.query(ToolCallBlock) if b.record.id == call_id and b.parent is not None), None)

    async def show_call(self, record: ToolRecord) -> ToolCallBlock:
        """Add the call's block, or update it (the blocks of earlier rounds keep their own ids)."""
        await self.flush()  # the text before the call first
        blocks = list(self.query(ToolCallBlock))
        block = next((b for b in reversed(blocks) if b.record.id == record.id), None)
        if block is not None and block.record.status not in ("ok", "error", "denied", "stopped"):
            block.set_record(record)
        else:
            block = ToolCallBlock(record)
            await self.query_one(".tools", Vertical).mount(block)
        if record.status != "asking":
            await self.query(ApprovalPrompt).remove()
        return block

    async def ask(self, record: ToolRecord) -> ApprovalPrompt:
        await self.flush()
        prompt = ApprovalPrompt(record)
        await self.query_one(".tools", Vertical).mount(prompt)
        return prompt

    async def new_round(self) -> None:
        """The model called tools: what it streamed so far belongs to that round; the answer starts again."""
        await self.stop_stream()
        await self.body.update("")
        self.start_stream()

    # ---- streaming -----------------------------------------------------------------------------------

    def start_stream(self) -> None:
        """Begin a reply; fragments then go through a MarkdownStream, which batches them between renders."""
        self.add_class("-streaming")
        self.query_one(".meta", Static).update(Content.styled("generating…", "italic"))
        self._stream = Markdown.get_stream(self.body)
        self._raw, self._answer_sent = "", ""

    def queue(self, fragment: str) -> None:
        """Keep a fragment for the next `flush`: the app shows a streaming reply some 15 times a second, not once
        a token (each showing costs the app's thread milliseconds, which a 2-core machine takes from decode)."""
        self._pending += fragment

    async def flush(self) -> None:
        """Show the fragments queued since the last flush."""
        pending, self._pending = self._pending, ""
        await self.append(pending)

    async def append(self, fragment: str) -> None:
        if self._stream is None or not fragment:
            return
        self._raw += fragment
        split = split_thinking(self._raw, streaming=True)
        self._show_thinking(split, streaming=True)
        answer = split.answer[: len(split.answer) - split.pending]
        if answer.startswith(self._answer_sent):
            if len(answer) > len(self._answer_sent):
                await self._stream.write(answer[len(self._answer_sent) :])
        else:  # a closing tag arrived: what looked like the answer was thinking (the template opened it)
            await self._stream.stop()
            await self.body.update(answer)
            self._stream = Markdown.get_stream(self.body)
        self._answer_sent = answer

    async def stop_stream(self) -> None:
        """Flush what is pending and end the stream (safe to call more than once)."""
        await self.flush()
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.stop()
        self.remove_class("-streaming")

    async def finish(self) -> None:
        """The reply is over (stats or error are on the turn): settle the text and show the outcome."""
        await self.stop_stream()
        split = split_thinking(self.turn.content)
        self._show_thinking(split)
        if self.body.source != split.answer:  # e.g. the engine trimmed a stop string
            await self.body.update(split.answer)
        self.show_outcome()

    def show_outcome(self) -> None:
        meta = self.query_one(".meta", Static)
        parts: list[Content] = []
        if self.turn.stats is not None:
            parts.append(Content(stats_line(self.turn.stats)))
            if tools := tools_line(self.turn):
                parts.append(Content.styled(tools, "$text-muted"))
            if thinking := thinking_token_count([t.text for t in self.turn.tokens]):
                answer = len(self.turn.tokens) - thinking
                parts.append(Content.styled(f"thinking {thinking} tokens · answer {answer} tokens", "$text-muted"))
        if self.turn.error:
            parts.append(Content.styled(f"⚠ generation failed: {self.turn.error}", "$text-error"))
        if not parts and not self.turn.content and self._stream is None:
            parts.append(Content.styled("(no reply)", "italic"))
        meta.update(Content("\n").join(parts))
        meta.display = bool(parts)
        self.set_class(bool(self.turn.error), "-failed")

    def action_copy_next_block(self) -> None:
        """Copy this reply's code blocks one at a time, cycling on each press."""
        blocks = code_blocks(self.turn.content)
        if not blocks:
            self.notify("This reply has no code block", severity="warning")
            return
        n = self._next_block % len(blocks)
        self._next_block = n + 1
        self.app.copy_to_clipboard(blocks[n].code)
        self.notify(f"Copied code block {n + 1}/{len(blocks)} ({blocks[n].label})")


class ToolNote(Static):
    """One line in the chat about the tools (a server that did not start), outside any message."""


class SystemPromptCard(Static, can_focus=False):
    """The system prompt in force, at the top of the chat; click to edit."""

    def set_text(self, text: str) -> None:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        if len(first) > 100:
            first = first[:99] + "…"
        more = " …" if len(text.strip().splitlines()) > 1 else ""
        self.update(Content.assemble(("System  ", "bold"), (first + more, "italic")))
        self.display = bool(text.strip())

    async def on_click(self) -> None:
        await self.run_action("app.system_prompt")


class Banner(Static):
    """What the empty chat shows: the model, its loading progress or error, and how to start."""

    def show(self, state: str, model_name: str, detail: str = "") -> None:
        """`state`: loading (detail: the progress line) | failed (detail: the error) | ready."""
        name = Content.styled(model_name, "bold")
        if state == "loading":
            body = Content.assemble("Loading ", name, "…\n", (detail, "$text-muted"))
        elif state == "failed":
            body = Content.assemble(
                ("Couldn't load ", "$text-error"),
                name,
                "\n",
                (detail, "$text-error"),
                "\n\nSaved chats are still here: ctrl+l lists them.",
            )
        else:
            rows = (
                (("Enter", "sends"), ("shift+enter / ctrl+j", "new line"), ("↑", "recalls"), ("Esc", "stops")),
                (
                    ("F2", "sampling"),
                    ("ctrl+l", "saved chats"),
                    ("ctrl+t", "system prompt"),
                    ("ctrl+p", "all commands"),
                ),
            )
            parts: list[Content | str | tuple[str, str]] = [name, " is ready.\n"]
            for row in rows:
                parts.append("\n")
                for i, (key, what) in enumerate(row):
                    parts += [" · " if i else "", (key, "bold"), f" {what}"]
            body = Content.assemble(*parts)
        self.update(body)
        self.set_classes(f"-{state}")


class ChatLog(VerticalScroll, can_focus=False):
    """The scrolling list of messages; stays pinned to the bottom while a reply streams."""

    def compose(self) -> ComposeResult:
        yield Banner("", id="banner")
        card = SystemPromptCard("", id="system-card")
        card.display = False
        yield card

    @property
    def banner(self) -> Banner:
        return self.query_one(Banner)

    def set_system_prompt(self, text: str) -> None:
        self.query_one(SystemPromptCard).set_text(text)

    def message_widgets(self) -> list[UserMessage | AssistantMessage]:
        return [w for w in self.children if isinstance(w, UserMessage | AssistantMessage)]

    def widget_for(self, turn: Turn) -> UserMessage | AssistantMessage | None:
        return next((w for w in self.message_widgets() if w.turn is turn), None)

    async def add_user(self, turn: Turn) -> UserMessage:
        widget = UserMessage(turn)
        await self.mount(widget)
        self._after_change()
        return widget

    async def add_note(self, text: str) -> ToolNote:
        note = ToolNote(Content(f"⚠ {text}"), markup=False)
        await self.mount(note)
        self.call_after_refresh(self._settle)
        return note

    async def add_assistant(self, turn: Turn, model_name: str) -> AssistantMessage:
        widget = AssistantMessage(turn, model_name)
        await self.mount(widget)
        self._after_change()
        return widget

    async def remove_turns(self, turns: list[Turn]) -> None:
        doomed = [w for w in self.message_widgets() if any(w.turn is t for t in turns)]
        for w in doomed:
            if isinstance(w, AssistantMessage):
                await w.stop_stream()
        await self.remove_children(doomed)
        self._after_change()

    async def show_chat(self, state: ChatState, model_name: str) -> None:
        """Replace whatever is shown with `state` (a new or resumed chat)."""
        for w in self.message_widgets():
            if isinstance(w, AssistantMessage):
                await w.stop_stream()
        await self.remove_children(self.message_widgets())
        self.set_system_prompt(state.system_prompt)
        widgets = [
            UserMessage(t) if t.role == "user" else AssistantMessage(t, state.model or model_name) for t in state.turns
        ]
        if widgets:
            await self.mount_all(widgets)
        self._after_change()

    def _after_change(self) -> None:
        self.banner.display = not self.message_widgets()
        self.call_after_refresh(self._settle)

    def _settle(self) -> None:
        """Pin to the bottom once the chat overflows (an anchored short chat would sit at the bottom)."""
        if self.max_scroll_y > 0:
            self.anchor()
        else:
            self.anchor(False)
            self.scroll_to(y=0, animate=False, immediate=True)

    def reveal(self, widget: UserMessage | AssistantMessage) -> None:
        """Scroll `widget` to the top once the layout has settled (after `_settle`), and stop following the end."""

        def now() -> None:
            self.anchor(False)
            self.scroll_to_widget(widget, animate=False, top=True, immediate=True)

        self.call_after_refresh(now)

    def follow(self) -> None:
        """While a reply grows: start following it once it overflows, unless the user scrolled away.

        Checked after the next refresh, when the layout knows how tall the reply has become.
        """
        self.call_after_refresh(self._follow_now)

    def _follow_now(self) -> None:
        if not self.is_anchored and self.max_scroll_y > 0:
            self.anchor()
