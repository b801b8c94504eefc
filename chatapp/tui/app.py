"""The chat app: composition, key bindings, and routing between the widgets and the chat service.

The conversation itself (sending, a reply's start and stop, saving, branches, export) lives in
`chatapp.chat_service.ChatService`, which knows nothing of Textual. The App owns the one inference worker
(`_generate`), turns the worker's messages into service calls, and shows the results; rendering lives in
`widgets/`, the palette's commands in `commands.py`. The engine is reached only through
`chatapp.backend.ChatBackend`.

Sending while a reply is being generated is refused with a notice, and the text stays in the box (Esc stops
the reply; then Enter sends). Queueing was the alternative; refusing keeps one obvious order of events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import events, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header
from textual.worker import Worker, WorkerState

from chatapp.attachments import AttachmentError, expand_read_command, read_attachment
from chatapp.backend import ChatBackend
from chatapp.chat_service import ActiveReply, ChatService, Refused
from chatapp.chat_state import ChatState, Turn, code_blocks
from chatapp.errors import describe_error
from chatapp.mcp.config import McpSettings
from chatapp.mcp.loop import ToolChat, accepts_tools
from chatapp.model_choices import ModelChoice
from chatapp.recorder import Recorder
from chatapp.reply_format import COMMAND as FORMAT_COMMAND
from chatapp.reply_format import FormatError, constrained, is_format_command, label, parse_format
from chatapp.tui.commands import chat_commands
from chatapp.tui.messages import (
    ApprovalNeeded,
    ModelFailed,
    ModelLoading,
    ModelReady,
    ReplyFailed,
    ReplyFinished,
    TokenReceived,
    ToolCallUpdated,
    ToolRoundEnded,
    ToolsStarted,
)
from chatapp.tui.widgets.attach import AttachScreen
from chatapp.tui.widgets.chat_log import AssistantMessage, ChatLog, UserMessage
from chatapp.tui.widgets.conversations import ConversationsScreen
from chatapp.tui.widgets.inspector import InspectorScreen
from chatapp.tui.widgets.model_picker import ModelPickerScreen
from chatapp.tui.widgets.prompt_input import PromptInput
from chatapp.tui.widgets.reply_format import ReplyFormatScreen
from chatapp.tui.widgets.sampling_panel import SamplingPanel
from chatapp.tui.widgets.status_bar import StatusBar
from chatapp.tui.widgets.system_prompt import SystemPromptScreen
from chatapp.tui.widgets.tool_call import ApprovalPrompt, ToolsScreen
from chatapp.tui.worker import BackendFactory, load_backend, stream_tool_turn
from engine.events import GrammarSpec
from engine.sampling import SamplingSettings

if TYPE_CHECKING:
    from chatapp.mcp.client import McpClient

# A streaming reply is shown at most this often (about 15 times a second): see `on_token_received`.
REPLY_REFRESH_S = 1 / 15

CHAT_ACTIONS = frozenset(
    {"stop", "cancel_edit", "new_chat", "regenerate", "edit_last", "copy_reply", "toggle_sampling"}
    | {"inspect", "conversations", "system_prompt", "export", "scroll_chat", "attach", "switch_model"}
)


class ChatApp(App[None]):
    CSS_PATH = "styles.tcss"
    TITLE = "chatapp"

    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("escape", "cancel_edit", "Cancel edit"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+r,f5", "regenerate", "Regenerate"),
        Binding("ctrl+g", "edit_last", "Edit"),
        Binding("ctrl+o", "copy_reply", "Copy"),
        Binding("f2,ctrl+s", "toggle_sampling", "Sampling"),
        Binding("f3", "inspect", "Inspect"),
        Binding("ctrl+l,f4", "conversations", "Chats"),
        Binding("ctrl+t", "system_prompt", "System"),
        Binding("f8", "export", "Export", show=False),
        Binding("f9", "attach", "Attach", show=False),
        Binding("f10", "switch_model", "Model", show=False),
        Binding("f1", "toggle_keys", "Keys", show=False),
        Binding("shift+pageup,ctrl+up", "scroll_chat(-1)", "Scroll up", show=False),
        Binding("shift+pagedown,ctrl+down", "scroll_chat(1)", "Scroll down", show=False),
    ]

    generating: reactive[bool] = reactive(False, init=False)
    """A reply is in flight: the worker owns the backend until its final message arrives."""
    editing: reactive[bool] = reactive(False, init=False)
    """The input holds a user message for editing; sending replaces it and what followed, on a new branch."""

    def __init__(
        self,
        backend_factory: BackendFactory,
        *,
        model_name: str,
        settings: SamplingSettings,
        system_prompt: str = "",
        store: Any | None = None,
        store_warning: str | None = None,
        export_dir: Path | None = None,
        theme: str | None = None,
        save_theme: Callable[[str], None] | None = None,
        model_choices: Callable[[], Sequence[ModelChoice]] | None = None,
        factory_for_model: Callable[[str], BackendFactory] | None = None,
        mcp: McpSettings | None = None,
        reply_format: GrammarSpec | None = None,
    ) -> None:
        super().__init__()
        self.mcp = mcp or McpSettings()
        """The MCP servers to start, the tools allowed without asking, the timeout and round limit."""
        self.tool_client: McpClient | None = None
        """The `chatapp.mcp.client.McpClient` once servers are configured; its tools are offered to the model."""
        self.tools_off: set[str] = set()
        """Tools the person turned off for this chat."""
        self.tools_allowed: set[str] = set(self.mcp.allow)
        """Tools that run without asking in this chat: the config's, and those answered "always"."""
        self._approvals: dict[int, Any] = {}  # an ApprovalPrompt's id -> the worker's Future waiting for it
        self.backend_factory = backend_factory
        self.model_choices = model_choices
        """What the model picker lists; None: no picker (a remote server, or a test's fixed backend)."""
        self.factory_for_model = factory_for_model
        """factory_for_model(spec): a backend factory that loads that model instead."""
        self.service = ChatService(
            Recorder(store, self._report_store_problem),
            model_name=model_name,
            settings=settings,
            system_prompt=system_prompt,
            reply_format=reply_format,
        )
        """The conversation: every change to the chat goes through it."""
        self.export_dir = export_dir or Path.cwd()
        self._chosen_theme = theme
        self._save_theme = save_theme
        """Called with a theme's name when the user picks one (not for the one the app starts with)."""
        self._store_warning = store_warning
        self._reply_widget: AssistantMessage | None = None  # the reply in flight, while it is on screen
        self._progress_timer: Timer | None = None  # set while the reply's new tokens wait to be shown
        self._editing_index: int | None = None

    # The service's state, read by the widgets' routing below (and by tests).
    state = property(lambda self: self.service.state)
    backend = property(lambda self: self.service.backend)
    model_name = property(lambda self: self.service.model_name)
    settings = property(lambda self: self.service.settings, lambda self, v: setattr(self.service, "settings", v))

    # ---- layout ---------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield ChatLog(id="chat-log")
                yield PromptInput(id="prompt")
            yield SamplingPanel(self.settings, id="sampling")
        yield StatusBar(self.model_name, id="status")
        yield Footer()

    chat_log = property(lambda self: self.query_one(ChatLog))
    prompt = property(lambda self: self.query_one(PromptInput))
    status = property(lambda self: self.query_one(StatusBar))
    panel = property(lambda self: self.query_one(SamplingPanel))

    def on_mount(self) -> None:
        if self._chosen_theme and self._chosen_theme in self.available_themes:
            self.theme = self._chosen_theme
        elif self._chosen_theme:
            self.notify(f"No theme {self._chosen_theme!r}; using {self.theme}.", severity="warning")
        self.theme_changed_signal.subscribe(self, self._theme_picked)
        self.sub_title = "New chat"
        self.panel.display = False
        self.status.reply_format = label(self.service.reply_format)
        self.status.set_state("loading", "starting…")
        self.status.show_stats(None)
        self._show_banner("loading", "starting…")
        self.chat_log.set_system_prompt(self.state.system_prompt)
        self.prompt.focus()
        if self._store_warning:
            self.notify(self._store_warning, title="Saved chats", severity="warning", timeout=10)
        if not self.service.recorder.enabled:
            self.notify("History is off: this chat will not be saved.", timeout=4)
        self._load_model(self.backend_factory)
        if self.mcp.servers:
            self.action_start_tools()

    # ---- tools ----------------------------------------------------------------------------------------

    def action_start_tools(self) -> None:
        """Start the configured MCP servers that are not running (at start, and from the palette)."""
        if not self.mcp.servers:
            return self.notify("No MCP servers configured ([mcp.servers] or --mcp-config).", severity="warning")
        if self.tool_client is None:
            from chatapp.mcp.client import McpClient

            self.tool_client = McpClient(self.mcp)
        self.status.tools = "starting tools…"
        self.status.refresh_state()
        self._start_tools(self.tool_client)

    @work(thread=True, group="mcp", exit_on_error=False)
    def _start_tools(self, client: Any) -> None:
        self.post_message(ToolsStarted(client.start()))

    async def on_tools_started(self, message: ToolsStarted) -> None:
        for line in message.failures:
            await self.chat_log.add_note(line)
        self._show_tool_count()

    def _show_tool_count(self) -> None:
        tools = self.tool_client.tools if self.tool_client is not None else []
        on = [t for t in tools if t.name not in self.tools_off]
        self.status.tools = f"{len(on)} tools" + (f" ({len(tools) - len(on)} off)" if len(on) < len(tools) else "")
        self.status.refresh_state()

    def action_list_tools(self) -> None:
        client = self.tool_client
        tools = client.tools if client is not None else []
        lines = client.server_lines() if client is not None else []

        def done(off: set[str] | None) -> None:
            if off is not None:
                self.tools_off = off
                self._show_tool_count()

        self.push_screen(ToolsScreen(tools, self.tools_off, lines), done)

    def _tool_chat(self) -> ToolChat | None:
        client = self.tool_client
        tools = [t for t in client.tools if t.name not in self.tools_off] if client is not None else []
        if client is None or not tools:
            return None
        return ToolChat(tools, client.call, self.tools_allowed, self.mcp.max_rounds)

    def _reset_tools_for_chat(self) -> None:
        self.tools_off = set()
        self.tools_allowed = set(self.mcp.allow)
        if self.tool_client is not None:
            self._show_tool_count()

    async def on_tool_round_ended(self, message: ToolRoundEnded) -> None:
        active = self.service.round_ended(message.turn, message.text, message.stats)
        if active is not None and active.shown and self._reply_widget is not None:
            await self._reply_widget.new_round()

    async def on_tool_call_updated(self, message: ToolCallUpdated) -> None:
        active = self.service.call_updated(message.turn, message.record)
        if active is not None and active.shown and self._reply_widget is not None:
            await self._reply_widget.show_call(message.record)
            self.chat_log.follow()

    async def on_approval_needed(self, message: ApprovalNeeded) -> None:
        active = self.service.current(message.turn)
        if active is None or not active.shown or self._reply_widget is None:
            message.answer.set_result("deny")  # nobody can see it: never run it unasked
            return
        prompt = await self._reply_widget.ask(message.record)
        self._approvals[id(prompt)] = message.answer
        prompt.focus()
        self.chat_log.follow()

    async def on_approval_prompt_answered(self, message: ApprovalPrompt.Answered) -> None:
        answer = self._approvals.pop(id(message.prompt), None)
        if answer is not None and not answer.done():
            answer.set_result(message.answer)
        await message.prompt.remove()
        self.prompt.focus()

    def _theme_picked(self, theme: Any) -> None:
        if self._save_theme is None or theme.name == self._chosen_theme:  # the one it started in, or saved
            return
        try:
            self._save_theme(theme.name)
            self._chosen_theme = theme.name
        except Exception as exc:  # the theme still applies; only remembering it failed
            self.notify(f"Couldn't save the theme: {describe_error(exc)}", severity="warning")

    def on_resize(self, event: events.Resize) -> None:
        """Narrow terminals get slimmer margins and panel (see `.-narrow` in styles.tcss)."""
        self.screen_stack[0].set_class(event.size.width < 100, "-narrow")

    def on_unmount(self) -> None:
        self.service.shutdown()
        for answer in self._approvals.values():
            if not answer.done():
                answer.set_result("deny")
        if self.tool_client is not None:
            self.tool_client.close()

    def _show_banner(self, state: str, detail: str = "") -> None:
        self.chat_log.banner.show(state, self.model_name, detail)

    def _refuse(self, refusal: Refused) -> None:
        self.notify(str(refusal), severity=refusal.severity)  # type: ignore[arg-type]

    # ---- the model ------------------------------------------------------------------------------------

    @work(thread=True, group="load", exit_on_error=False)
    def _load_model(self, factory: BackendFactory) -> None:
        load_backend(factory, self.post_message)

    def on_model_loading(self, message: ModelLoading) -> None:
        if self.service.switching is not None:  # the current model stays in use meanwhile: the status line only
            self.status.set_state("loading", f"{self.service.switching}: {message.text}")
            return
        self.status.set_state("loading", message.text)
        self._show_banner("loading", message.text)

    def action_switch_model(self) -> None:
        if self.model_choices is None or self.factory_for_model is None:
            self.notify("Models cannot be switched here.", severity="warning")
        elif self.generating or self.service.switching is not None:
            self.notify("Wait for the reply (Esc stops it) or the load in progress.", severity="warning")
        else:
            self.push_screen(ModelPickerScreen(self.model_choices(), current=self.model_name), self._switch_to)

    def _switch_to(self, spec: str | None) -> None:
        if spec is None or self.factory_for_model is None:
            return
        try:
            self.service.begin_switch(spec)
        except Refused as refusal:
            return self._refuse(refusal)
        self.status.set_state("loading", f"{spec}…")
        self._load_model(self.factory_for_model(spec))

    def on_model_ready(self, message: ModelReady) -> None:
        switched = self.service.model_ready(message.backend)
        backend = message.backend
        self.status.model_name = self.model_name
        self.status.n_ctx = backend.n_ctx
        self.panel.set_max_tokens_cap(backend.n_ctx or None)
        remote = backend.remote
        if remote is not None:
            self.status.remote = f"remote · {remote.server}"
            self.panel.set_remote(remote.server, remote.honoured, remote.ignored)
        self._apply_settings(self.service.sync_settings)
        if problem := self.service.check_reply_format():  # e.g. a grammar this vocabulary cannot spell
            self.notify(problem, title="Reply format", severity="error", timeout=15)
        self.status.reply_format = label(self.service.reply_format)
        self.status.set_state("ready")
        self.status.show_stats(None)
        self._show_banner("ready")
        self._show_warnings()
        if self.mcp.servers and not accepts_tools(backend):
            self.notify("This model's backend cannot call tools: they are not offered to it.", severity="warning")
        if switched is not None:
            self.notify(f"Now chatting with {self.model_name}; this chat carries over, and the next message "
                        "evaluates it on the new model.", title="Model")  # fmt: skip

    def on_model_failed(self, message: ModelFailed) -> None:
        failed = self.service.model_failed(message.error)
        if failed is not None:  # the old model is still there: keep it
            self.status.set_state("ready")
            self.notify(f"{failed}: {message.error}. Still using {self.model_name}.",
                        title="Couldn't switch the model", severity="error", timeout=15)  # fmt: skip
            return
        self.status.set_state("failed", message.error)
        self._show_banner("failed", message.error)
        self.notify(message.error, title="Couldn't load the model", severity="error", timeout=15)

    def _show_warnings(self, extra: Iterable[str] = ()) -> None:
        for text in self.service.new_warnings(extra):
            self.notify(text, title="Engine", severity="warning", timeout=10)

    # ---- generating -----------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="inference", exit_on_error=False)
    def _generate(self, backend: ChatBackend, active: ActiveReply) -> None:
        """The one inference worker: runs `backend.stream_reply` (and the tool loop), posts messages, never touches
        widgets."""
        backend = constrained(backend, active.constraint)
        stream_tool_turn(backend, active.messages, active.turn, self.post_message, active.stop, self._tool_chat())

    async def _start_reply(self, active: ActiveReply) -> None:
        widget = self._reply_widget = await self.chat_log.add_assistant(active.reply, self.model_name)
        widget.start_stream()
        self.generating = True
        self.status.show_live(active.metrics)
        assert self.backend is not None
        self._generate(self.backend, active)

    async def on_token_received(self, message: TokenReceived) -> None:
        """Each token goes into the chat's state at once; the screen shows them REPLY_REFRESH_S apart. Shown one
        by one, the UI thread's work came out of decode's cores: SmolLM2 streamed at 75 tok/s through the TUI
        against 213 in the engine alone on 2 cores; shown 30 times a second, 115-122 (against 225-236 alone);
        15 times, 138-141; 10 times, 140-144. Each showing reflows and repaints the screen (Textual's
        compositor: most of the UI thread's time while a reply streams)."""
        active = self.service.token(message.turn, message.event, message.elapsed_ms)
        if active is not None and active.shown and self._reply_widget is not None:
            self._reply_widget.queue(message.event.text)
            if self._progress_timer is None:
                self._progress_timer = self.set_timer(REPLY_REFRESH_S, self._show_progress)

    async def _show_progress(self) -> None:
        """The reply's queued text, the scroll that follows it and the live speed, on screen."""
        self._progress_timer = None
        active = self.service.active
        if active is not None and active.shown and self._reply_widget is not None:
            await self._reply_widget.flush()
            self.chat_log.follow()
            self.status.show_live(active.metrics)

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        active = self.service.finished(message.turn, message.stats)
        if active is not None:
            await self._reply_ended(active)
            if active.shown:
                self.status.show_stats(message.stats)
            self._show_warnings(message.stats.warnings)

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        active = self.service.failed(message.turn, message.error)
        if active is not None:
            await self._reply_ended(active)
            self.notify(message.error, title="Generation failed", severity="error", timeout=10)
            self._show_warnings()

    async def _reply_ended(self, active: ActiveReply) -> None:
        widget, self._reply_widget = self._reply_widget, None
        for prompt in self.query(ApprovalPrompt):  # a stopped reply's question is moot
            if (answer := self._approvals.pop(id(prompt), None)) is not None and not answer.done():
                answer.set_result("deny")
            await prompt.remove()
        self._mark_branches()
        if active.shown and widget is not None:
            await widget.finish()
            # the reply's last text may only now make it overflow, once its Markdown blocks are laid out
            self.chat_log.follow()
            self.call_after_refresh(self.chat_log.follow)
        self.generating = False

    async def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker that died outside our own error handling still ends the reply, as a failure."""
        error = event.worker.error
        if event.state != WorkerState.ERROR or error is None:
            return
        active = self.service.active
        if event.worker.group == "inference" and active is not None:
            await self.on_reply_failed(ReplyFailed(active.turn, describe_error(error)))
        elif event.worker.group == "load":
            self.on_model_failed(ModelFailed(describe_error(error)))

    def watch_generating(self, generating: bool) -> None:
        self.status.set_state("generating" if generating else "ready" if self.backend else "failed")
        self.refresh_bindings()

    def watch_editing(self, editing: bool) -> None:
        self.prompt.border_title = "Editing your last message · Enter resends · Esc cancels" if editing else ""
        self.prompt.set_class(editing, "-editing")
        self.refresh_bindings()

    # ---- sending --------------------------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if is_format_command(event.text):  # /format …: set on success; on a mistake it stays in the box
            if self.set_reply_format(event.text.strip()[len(FORMAT_COMMAND) :]):
                self.prompt.clear()
            return
        try:
            expanded = expand_read_command(event.text)
        except AttachmentError as e:
            self.notify(str(e), title="Attach", severity="error")
            return  # the command stays in the box, to correct
        if expanded is not None:  # /read PATH: the file goes into the box, for the user to ask about
            self.prompt.set_text(expanded)
            return
        text, index = event.text.strip(), self._editing_index
        try:
            self.service.check_ready()
        except Refused as refusal:
            return self._refuse(refusal)  # the text stays in the box
        if index is None:
            turn = self.service.send(text)
        else:
            self._end_edit()
            doomed, turn = self.service.edit(index, text)
            await self.chat_log.remove_turns(doomed)
        self.prompt.remember(text)
        self.prompt.clear()
        self.sub_title = self.state.title or "New chat"
        await self.chat_log.add_user(turn)
        await self._start_reply(self.service.start_reply())

    # ---- actions --------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in CHAT_ACTIONS and self.screen is not self.screen_stack[0]:
            return False  # on the inspector and dialogs, the chat's keys are not shown and do nothing
        if action == "stop":
            return self.generating
        if action == "cancel_edit":
            return self.editing and not self.generating
        return True

    def action_stop(self) -> None:
        """Esc: ask the engine to stop after the current token; the partial reply stays."""
        try:
            if self.service.stop():
                self.status.set_state("stopping")
        except Refused as refusal:
            self._refuse(refusal)

    def action_cancel_edit(self) -> None:
        self._end_edit()
        self.prompt.clear()

    def _end_edit(self) -> None:
        if self._editing_index is not None and self._editing_index < len(self.state.turns):
            widget = self.chat_log.widget_for(self.state.turns[self._editing_index])
            if widget is not None:
                widget.remove_class("-editing")
        self._editing_index = None
        self.editing = False

    def _focused_turn(self, role: str) -> tuple[int, Turn] | None:
        """The focused message of `role` in the chat (its index and turn), else the last one of that role."""
        widget = self.focused
        turn = getattr(widget, "turn", None)
        index = next((i for i, t in enumerate(self.state.turns) if t is turn), None)
        if isinstance(widget, (UserMessage, AssistantMessage)) and index is not None and turn is not None:
            if turn.role == role:
                return index, turn
            if role == "user" and index > 0 and self.state.turns[index - 1].role == "user":  # a reply's question
                return index - 1, self.state.turns[index - 1]
        return self.state.last(role)

    async def action_regenerate(self) -> None:
        """A new reply to the focused message's question (else the last one); the old reply is kept as a
        branch."""
        found = self._focused_turn("user")
        try:
            if found is None:
                self.service.check_ready()
                raise Refused("Nothing to regenerate yet.")
            doomed, active = self.service.regenerate(found[0])
        except Refused as refusal:
            return self._refuse(refusal)
        self._end_edit()
        await self.chat_log.remove_turns(doomed)
        await self._start_reply(active)

    async def action_branch(self, step: int) -> None:
        """Show the focused message's previous (-1) or next (+1) version, and the branch that follows it."""
        turn = getattr(self.focused, "turn", None)
        if self.generating:
            return self.notify("A reply is being generated: Esc stops it first.", severity="warning")
        if not isinstance(self.focused, (UserMessage, AssistantMessage)) or turn is None or not self.state.conv_id:
            return self.notify("Focus a message (Tab) to move between its versions.", severity="warning")
        try:
            state = self.service.other_version(turn, step)
        except Refused as refusal:
            return self._refuse(refusal)
        if state is not None:
            await self._show_state(state)

    def _mark_branches(self) -> None:
        """Each message with other versions shows which one it is, ‹ 2/3 ›, on its border."""
        for turn, mark in self.service.branch_marks():
            if (widget := self.chat_log.widget_for(turn)) is not None:
                widget.border_subtitle = f"{mark} ←→" if mark else ""

    def action_edit_last(self) -> None:
        """Edit the focused message (else the last one); sending it starts a branch, the old one is kept."""
        if self.generating:
            return self.notify("A reply is being generated: Esc stops it first.", severity="warning")
        found = self._focused_turn("user")
        if found is None:
            return self.notify("No message to edit yet.", severity="warning")
        self._end_edit()
        self._editing_index, turn = found
        self.editing = True
        if (widget := self.chat_log.widget_for(turn)) is not None:
            widget.add_class("-editing")
            widget.scroll_visible()
        self.prompt.set_text(turn.content)
        self.prompt.focus()

    async def _show_state(self, state: ChatState, found: int | None = None) -> None:
        """Put the service's chat on screen; `found`: the id of a message to focus."""
        if self._reply_widget is not None:  # the reply in flight goes on, unseen, and is still saved
            widget, self._reply_widget = self._reply_widget, None
            await widget.stop_stream()
        self._end_edit()
        await self.chat_log.show_chat(state, self.model_name)
        self.sub_title = state.title or "New chat"
        self.status.show_stats(self.service.last_stats())
        self.prompt.focus()
        self._mark_branches()
        turn = next((t for t in state.turns if found is not None and t.msg_id == found), None)
        if turn is not None and (widget := self.chat_log.widget_for(turn)) is not None:
            self.chat_log.reveal(widget)
            widget.focus(scroll_visible=False)  # the found message, ready to read; Tab moves on

    async def action_new_chat(self) -> None:
        self._reset_tools_for_chat()
        await self._show_state(self.service.new_chat())
        self.prompt.clear()

    def action_attach(self) -> None:
        self.push_screen(AttachScreen(), self._attach_file)

    def _attach_file(self, path: str | None) -> None:
        """AttachScreen's answer (not `_attach`: Textual's MessagePump has its own)."""
        if path is None:
            return
        try:
            block = read_attachment(path)
        except AttachmentError as e:
            return self.notify(str(e), title="Attach", severity="error")
        draft = self.prompt.text.strip("\n")
        self.prompt.set_text(block + "\n\n" + (draft + "\n" if draft else ""))
        self.prompt.focus()

    def action_conversations(self) -> None:
        recorder = self.service.recorder
        if not recorder.enabled:
            return self.notify("History is off, so there are no saved chats.", severity="warning")
        screen = ConversationsScreen(recorder.conversations(), current=self.state.conv_id, search=recorder.search)
        self.push_screen(screen, self._resume)

    async def _resume(self, choice: tuple[int, int | None] | None) -> None:
        if choice is None:
            return
        state = self.service.resume(choice[0])
        if state is None:
            return
        self._reset_tools_for_chat()
        await self._show_state(state, found=choice[1])
        for turn in state.turns:
            if turn.role == "user":
                self.prompt.remember(turn.content)
        if state.model != self.model_name:
            self.notify(f"This chat was saved with {state.model}; replies now come from {self.model_name}.")

    def on_conversations_screen_delete(self, message: ConversationsScreen.Delete) -> None:
        self.service.delete(message.conv_id)
        self.notify("Chat deleted.")

    def on_conversations_screen_export(self, message: ConversationsScreen.Export) -> None:
        self.action_export(message.conv_id)

    def action_system_prompt(self) -> None:
        def done(text: str | None) -> None:
            if text is not None and self.service.set_system_prompt(text):
                self.chat_log.set_system_prompt(text)
                self.notify("System prompt set; it applies from the next reply." if text else "System prompt cleared.")

        self.push_screen(SystemPromptScreen(self.state.system_prompt), done)

    def action_reply_format(self, value: str = "") -> None:
        """The reply format dialog; a mistake reopens it with the text typed."""

        def done(text: str | None) -> None:
            if text is not None and not self.set_reply_format(text):
                self.action_reply_format(text)

        self.push_screen(ReplyFormatScreen(value), done)

    def clear_reply_format(self) -> None:
        self.set_reply_format("off")

    def set_reply_format(self, text: str) -> bool:
        """Apply `json FILE|JSON`, `grammar FILE` or `off` from the next reply; False (and why, shown) if not."""
        try:
            self.service.set_reply_format(parse_format(text))
        except FormatError as e:
            self.notify(f"Reply format not set: {e}", title="Reply format", severity="error", timeout=10)
            return False
        except Refused as refusal:
            self._refuse(refusal)
            return False
        self.status.reply_format = shown = label(self.service.reply_format)
        self.status.refresh_state()
        self.notify(f"Replies match the {shown} from the next one." if shown else "Reply format cleared.")
        return True

    def action_toggle_sampling(self) -> None:
        panel = self.panel
        panel.display = not panel.display
        if panel.display:
            panel.focus_first()
        else:
            self.prompt.focus()

    def on_sampling_panel_changed(self, message: SamplingPanel.Changed) -> None:
        self._apply_settings(lambda: self.service.apply_settings(message.settings))

    def _apply_settings(self, apply: Callable[[], str | None]) -> None:
        """Run a settings change through the service; say what it says; show the values in force."""
        try:
            if note := apply():
                self.notify(note)
        except Refused as refusal:
            self._refuse(refusal)
        self.panel.settings = self.settings

    def target_reply(self) -> Turn | None:
        """The focused reply, else the last one."""
        if isinstance(self.focused, AssistantMessage):
            return self.focused.turn
        found = self.state.last("assistant")
        return found[1] if found else None

    def action_inspect(self) -> None:
        turn = self.target_reply()
        if turn is None:
            return self.notify("No reply to inspect yet.", severity="warning")
        replies = [t for t in self.state.turns if t.role == "assistant"]
        number = next(i for i, t in enumerate(replies, 1) if t is turn)
        model = self.state.model or self.model_name
        title = f"Reply {number} of {len(replies)} · {model} · {len(turn.tokens)} tokens"
        self.push_screen(InspectorScreen(turn, title=title))

    def action_copy_reply(self) -> None:
        turn = self.target_reply()
        if turn is None or not turn.content:
            return self.notify("No reply to copy yet.", severity="warning")
        self.copy_to_clipboard(turn.content)
        self.notify(f"Copied the reply ({len(turn.content):,} characters).")

    def action_copy_code(self, number: int) -> None:
        turn = self.target_reply()
        blocks = code_blocks(turn.content) if turn else []
        if not 1 <= number <= len(blocks):
            return self.notify("That code block is not there.", severity="warning")
        self.copy_to_clipboard(blocks[number - 1].code)
        self.notify(f"Copied code block {number} ({blocks[number - 1].label}).")

    def action_export(self, conv_id: int | None = None) -> None:
        """Write the chat as Markdown into `export_dir` and say where."""
        try:
            path = self.service.export(self.export_dir, conv_id)
        except Refused as refusal:
            return self._refuse(refusal)
        if path is not None:
            self.notify(f"Exported to {path}", title="Export", timeout=10)

    def action_scroll_chat(self, pages: int) -> None:
        """Page through the chat while the message box keeps the focus."""
        if pages < 0:
            self.chat_log.release_anchor()
            self.chat_log.scroll_page_up(animate=False)
        else:
            self.chat_log.scroll_page_down(animate=False)

    def action_toggle_keys(self) -> None:
        if self.screen.query("KeyPanel"):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def _report_store_problem(self, text: str) -> None:
        self.notify(text, title="Saved chats", severity="error", timeout=10)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield from chat_commands(self)

