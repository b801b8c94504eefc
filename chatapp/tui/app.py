"""The chat app: wires the widgets, the conversation state, the store and the one inference worker.

The App holds the state and reacts to messages; rendering lives in `widgets/`, the chat as data in `state.py`,
saving in `recorder.py`, and what the background threads do in `worker.py`. The engine is reached only through
`chatapp.backend.ChatBackend`.

Sending while a reply is being generated is refused with a notice, and the text stays in the box (Esc stops
the reply; then Enter sends). Queueing was the alternative; refusing keeps one obvious order of events.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textual import events, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Header
from textual.worker import Worker, WorkerState

from chatapp.attachments import AttachmentError, expand_read_command, read_attachment
from chatapp.backend import ChatBackend
from chatapp.model_choices import ModelChoice
from chatapp.store import suggest_title
from chatapp.tui.messages import (
    ModelFailed,
    ModelLoading,
    ModelReady,
    ReplyFailed,
    ReplyFinished,
    TokenReceived,
)
from chatapp.tui.recorder import Recorder, write_export
from chatapp.tui.state import ChatState, LiveMetrics, Turn, code_blocks, stats_from_dict, to_markdown
from chatapp.tui.widgets.attach import AttachScreen
from chatapp.tui.widgets.chat_log import AssistantMessage, ChatLog, UserMessage
from chatapp.tui.widgets.conversations import ConversationsScreen
from chatapp.tui.widgets.inspector import InspectorScreen
from chatapp.tui.widgets.model_picker import ModelPickerScreen
from chatapp.tui.widgets.prompt_input import PromptInput
from chatapp.tui.widgets.sampling_panel import SamplingPanel
from chatapp.tui.widgets.status_bar import StatusBar
from chatapp.tui.widgets.system_prompt import SystemPromptScreen
from chatapp.tui.worker import BackendFactory, describe_error, load_backend, stream_turn
from engine.events import Message
from engine.sampling import SamplingSettings


@dataclass
class ActiveReply:
    """The reply being generated. Outlives its widget if the user leaves the chat: it is still saved."""

    turn: int  # matches the worker's messages to this reply
    reply: Turn
    conv_id: int | None
    widget: AssistantMessage | None  # None once the chat on screen is another one
    metrics: LiveMetrics
    stop: threading.Event = field(default_factory=threading.Event)  # set when the user asked to stop
    told_next_reply: bool = False  # remote: the user was told a settings change waits for the next reply


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
    """The input holds the last user message for editing; sending replaces it and what followed."""

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
    ) -> None:
        super().__init__()
        self.model_choices = model_choices
        """What the model picker lists; None: no picker (a remote server, or a test's fixed backend)."""
        self.factory_for_model = factory_for_model
        """factory_for_model(spec): a backend factory that loads that model instead."""
        self._switching: str | None = None  # the model being loaded in place of the current one
        self._chosen_theme = theme
        self._save_theme = save_theme
        """Called with a theme's name when the user picks one (not for the one the app starts with)."""
        self.backend_factory = backend_factory
        self.backend: ChatBackend | None = None
        """Set when the model has loaded (ModelReady); None while loading or after a failed load."""
        self.model_name = model_name
        self.settings = settings
        """The sampling settings the user chose (pushed to the backend as soon as there is one)."""
        self.default_system_prompt = system_prompt
        self.state = ChatState(model=model_name, system_prompt=system_prompt)
        self.recorder = Recorder(store, self._report_store_problem)
        self.export_dir = export_dir or Path.cwd()
        self._store_warning = store_warning
        self._load_error: str | None = None
        self._active: ActiveReply | None = None
        self._turn = 0
        self._editing_index: int | None = None
        self._shown_warnings: set[str] = set()

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

    @property
    def chat_log(self) -> ChatLog:
        return self.query_one(ChatLog)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def panel(self) -> SamplingPanel:
        return self.query_one(SamplingPanel)

    def on_mount(self) -> None:
        if self._chosen_theme and self._chosen_theme in self.available_themes:
            self.theme = self._chosen_theme
        elif self._chosen_theme:
            self.notify(f"No theme {self._chosen_theme!r}; using {self.theme}.", severity="warning")
        self.theme_changed_signal.subscribe(self, self._theme_picked)
        self.sub_title = "New chat"
        self.panel.display = False
        self.status.set_state("loading", "starting…")
        self.status.show_stats(None)
        self._show_banner("loading", "starting…")
        self.chat_log.set_system_prompt(self.state.system_prompt)
        self.prompt.focus()
        if self._store_warning:
            self.notify(self._store_warning, title="Saved chats", severity="warning", timeout=10)
        if not self.recorder.enabled:
            self.notify("History is off: this chat will not be saved.", timeout=4)
        self._load_model()

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
        """Quitting mid-reply: stop the engine, or the process would wait for the reply's last token; and save
        the reply as far as it was shown (progress saves lag by up to the recorder's interval)."""
        active = self._active
        if active is None:
            return
        active.stop.set()
        if self.backend is not None:
            try:
                self.backend.cancel()
            except Exception:
                pass  # leaving anyway
        self.recorder.reply_done(active.conv_id, active.reply)

    def _show_banner(self, state: str, detail: str = "") -> None:
        self.chat_log.banner.show(state, self.model_name, detail)

    # ---- the model ------------------------------------------------------------------------------------

    @work(thread=True, group="load", exit_on_error=False)
    def _load_model(self) -> None:
        load_backend(self.backend_factory, self.post_message)

    def on_model_loading(self, message: ModelLoading) -> None:
        if self._switching is not None:  # the current model stays in use meanwhile: the status line only
            self.status.set_state("loading", f"{self._switching}: {message.text}")
            return
        self.status.set_state("loading", message.text)
        self._show_banner("loading", message.text)

    def action_switch_model(self) -> None:
        if self.model_choices is None or self.factory_for_model is None:
            self.notify("Models cannot be switched here.", severity="warning")
            return
        if self.generating or self._switching is not None:
            self.notify("Wait for the reply (Esc stops it) or the load in progress.", severity="warning")
            return
        self.push_screen(ModelPickerScreen(self.model_choices(), current=self.model_name), self._switch_to)

    def _switch_to(self, spec: str | None) -> None:
        if spec is None or self.factory_for_model is None:
            return
        self._switching = spec
        self.status.set_state("loading", f"{spec}…")
        self._load_other_model(self.factory_for_model(spec))

    @work(thread=True, group="load", exit_on_error=False)
    def _load_other_model(self, factory: BackendFactory) -> None:
        load_backend(factory, self.post_message)

    def on_model_ready(self, message: ModelReady) -> None:
        switched, self._switching = self._switching, None
        if switched is not None:
            self._shown_warnings.clear()  # the new model's warnings are news
        backend = self.backend = message.backend
        self.model_name = getattr(backend, "model_name", "") or self.model_name
        if not self.state.turns:  # the chat on screen was begun before the name was known (a remote server's)
            self.state.model = self.model_name
        self.status.model_name = self.model_name
        self.status.n_ctx = backend.n_ctx
        self.panel.set_max_tokens_cap(backend.n_ctx or None)
        remote = getattr(backend, "remote", None)  # a server's model (chatapp.remote.RemoteInfo)
        if remote is not None:
            self.status.remote = f"remote · {remote.server}"
            self.panel.set_remote(remote.server, remote.honoured, remote.ignored)
        if backend.settings != self.settings:  # changed in the panel while loading
            self._apply_settings(self.settings)
        self.panel.settings = backend.settings
        self.status.set_state("ready")
        self.status.show_stats(None)
        self._show_banner("ready")
        self._show_warnings()
        if switched is not None:
            self.state.model = self.model_name
            self.notify(f"Now chatting with {self.model_name}; this chat carries over, and the next message "
                        "evaluates it on the new model.", title="Model")  # fmt: skip

    def on_model_failed(self, message: ModelFailed) -> None:
        failed, self._switching = self._switching, None
        if failed is not None and self.backend is not None:  # the old model is still there: keep it
            self.status.set_state("ready")
            self.notify(f"{failed}: {message.error}. Still using {self.model_name}.",
                        title="Couldn't switch the model", severity="error", timeout=15)  # fmt: skip
            return
        self._load_error = message.error
        self.status.set_state("failed", message.error)
        self._show_banner("failed", message.error)
        self.notify(message.error, title="Couldn't load the model", severity="error", timeout=15)

    def _show_warnings(self, extra: Iterable[str] = ()) -> None:
        """Engine warnings as notifications, each shown once per session."""
        found = list(extra)
        if self.backend is not None:
            try:
                found += list(self.backend.warnings())
            except Exception as exc:  # warnings are advisory; never fail over them
                found.append(f"could not read the engine's warnings: {describe_error(exc)}")
        for text in found:
            if text not in self._shown_warnings:
                self._shown_warnings.add(text)
                self.notify(text, title="Engine", severity="warning", timeout=10)

    def _ready_to_generate(self) -> bool:
        """True if a reply may start now; otherwise tell the user why not."""
        if self.backend is None:
            if self._load_error is not None:
                self.notify(f"No model: {self._load_error}", severity="error")
            else:
                self.notify("The model is still loading…", severity="warning")
            return False
        if self.generating:
            self.notify("A reply is being generated: Esc stops it, then send again.", severity="warning")
            return False
        if self._switching is not None:
            self.notify(f"Loading {self._switching}; send when it is ready.", severity="warning")
            return False
        return True

    # ---- generating -----------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="inference", exit_on_error=False)
    def _generate(self, messages: Sequence[Message], turn: int, stop: threading.Event) -> None:
        """The one inference worker: runs `backend.stream_reply`, posts messages, never touches widgets."""
        assert self.backend is not None
        stream_turn(self.backend, messages, turn, self.post_message, stop)

    async def _start_reply(self) -> None:
        messages = self.state.backend_messages()
        reply = Turn("assistant", "")
        self.state.turns.append(reply)
        widget = await self.chat_log.add_assistant(reply, self.model_name)
        widget.start_stream()
        self._turn += 1
        self._active = ActiveReply(self._turn, reply, self.state.conv_id, widget, LiveMetrics())
        self.generating = True
        self.status.show_live(self._active.metrics)
        self._generate(messages, self._turn, self._active.stop)

    def _current(self, turn: int) -> ActiveReply | None:
        active = self._active
        return active if active is not None and active.turn == turn else None

    async def on_token_received(self, message: TokenReceived) -> None:
        active = self._current(message.turn)
        if active is None:
            return
        event = message.event
        active.reply.tokens.append(event)
        active.reply.content += event.text
        active.metrics.add(event, message.elapsed_ms)
        self.recorder.reply_progress(active.conv_id, active.reply)
        if active.widget is not None:
            await active.widget.append(event.text)
            self.chat_log.follow()
            self.status.show_live(active.metrics)

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        active = self._current(message.turn)
        if active is None:
            return
        self._active = None
        reply, stats = active.reply, message.stats
        reply.stats = stats
        if stats.reply:
            reply.content = stats.reply
        self.recorder.reply_done(active.conv_id, reply)
        self._mark_branches()
        if active.widget is not None:
            await active.widget.finish()
            self.chat_log.follow()
            self.status.show_stats(stats)
        self.generating = False
        self._show_warnings(stats.warnings)

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        active = self._current(message.turn)
        if active is None:
            return
        self._active = None
        active.reply.error = message.error
        self.recorder.reply_done(active.conv_id, active.reply)
        if active.widget is not None:
            await active.widget.finish()
            self.chat_log.follow()
        self.generating = False
        self.notify(message.error, title="Generation failed", severity="error", timeout=10)
        self._show_warnings()

    async def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker that died outside our own error handling still ends the reply, as a failure."""
        if event.state == WorkerState.ERROR and event.worker.group == "inference" and self._active:
            await self.on_reply_failed(ReplyFailed(self._active.turn, describe_error(event.worker.error)))
        elif event.state == WorkerState.ERROR and event.worker.group == "load":
            self.on_model_failed(ModelFailed(describe_error(event.worker.error)))

    def watch_generating(self, generating: bool) -> None:
        self.status.set_state("generating" if generating else "ready" if self.backend else "failed")
        self.refresh_bindings()

    def watch_editing(self, editing: bool) -> None:
        self.prompt.border_title = "Editing your last message · Enter resends · Esc cancels" if editing else ""
        self.prompt.set_class(editing, "-editing")
        self.refresh_bindings()

    # ---- sending --------------------------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        try:
            expanded = expand_read_command(event.text)
        except AttachmentError as e:
            self.notify(str(e), title="Attach", severity="error")
            return  # the command stays in the box, to correct
        if expanded is not None:  # /read PATH: the file goes into the box, for the user to ask about
            self.prompt.set_text(expanded)
            return
        text = event.text.strip()
        if not self._ready_to_generate():
            return  # the text stays in the box
        if self._editing_index is not None:
            index = self._editing_index
            self._end_edit()
            await self._drop_turns_from(index)
        self.prompt.remember(text)
        self.prompt.clear()
        turn = Turn("user", text)
        self.state.turns.append(turn)
        self.state.title = self.state.title or suggest_title(text)
        self.recorder.add_user(self.state, turn)
        self.sub_title = self.state.title or "New chat"
        await self.chat_log.add_user(turn)
        await self._start_reply()

    async def _drop_turns_from(self, index: int) -> None:
        """Take turns[index:] off the screen (regenerate, edit); in the store they stay, as another branch,
        and what comes next starts a new one from the turn before."""
        doomed = self.state.turns[index:]
        keep = self.state.saved_id_before(index)
        del self.state.turns[index:]
        await self.chat_log.remove_turns(doomed)
        self.recorder.branch_at(self.state.conv_id, keep)

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
        if self.backend is None or not self.generating:
            return
        if self._active is not None:
            self._active.stop.set()
        try:
            self.backend.cancel()
        except Exception as exc:
            self.notify(f"Couldn't stop the reply: {describe_error(exc)}", severity="error")
            return
        self.status.set_state("stopping")

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
        if isinstance(widget, (UserMessage, AssistantMessage)) and index is not None:
            if turn.role == role:
                return index, turn
            if role == "user" and index > 0 and self.state.turns[index - 1].role == "user":  # a reply's question
                return index - 1, self.state.turns[index - 1]
        return self.state.last(role)

    async def action_regenerate(self) -> None:
        """A new reply to the focused message's question (else the last one); the old reply is kept as a
        branch."""
        if not self._ready_to_generate():
            return
        found = self._focused_turn("user")
        if found is None:
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        self._end_edit()
        await self._drop_turns_from(found[0] + 1)
        await self._start_reply()

    async def action_branch(self, step: int) -> None:
        """Show the focused message's previous (-1) or next (+1) version, and the branch that follows it."""
        if self.generating:
            self.notify("A reply is being generated: Esc stops it first.", severity="warning")
            return
        widget = self.focused
        turn = getattr(widget, "turn", None)
        if not isinstance(widget, (UserMessage, AssistantMessage)) or turn is None or self.state.conv_id is None:
            self.notify("Focus a message (Tab) to move between its versions.", severity="warning")
            return
        versions = self.recorder.siblings(turn.msg_id)
        if len(versions) < 2:
            self.notify("This message has no other version.", severity="warning")
            return
        target = versions[(versions.index(turn.msg_id) + step) % len(versions)]
        if self.recorder.switch_branch(self.state.conv_id, target):
            await self._resume((self.state.conv_id, target))

    def _mark_branches(self) -> None:
        """Each message with other versions shows which one it is, ‹ 2/3 ›, on its border."""
        for turn in self.state.turns:
            widget = self.chat_log.widget_for(turn)
            versions = self.recorder.siblings(turn.msg_id)
            if widget is not None:
                at = versions.index(turn.msg_id) + 1 if turn.msg_id in versions else 0
                widget.border_subtitle = f"‹ {at}/{len(versions)} › ←→" if len(versions) > 1 else ""

    def action_edit_last(self) -> None:
        """Edit the focused message (else the last one); sending it starts a branch, the old one is kept."""
        if self.generating:
            self.notify("A reply is being generated: Esc stops it first.", severity="warning")
            return
        found = self._focused_turn("user")
        if found is None:
            self.notify("No message to edit yet.", severity="warning")
            return
        self._end_edit()
        index, turn = found
        self._editing_index = index
        self.editing = True
        widget = self.chat_log.widget_for(turn)
        if widget is not None:
            widget.add_class("-editing")
            widget.scroll_visible()
        self.prompt.set_text(turn.content)
        self.prompt.focus()

    async def _leave_chat(self) -> None:
        """Before another chat is shown: stop the reply in flight (it is still saved) and any edit."""
        if self._active is not None and self._active.widget is not None:
            self._active.stop.set()
            if self.backend is not None:
                try:
                    self.backend.cancel()
                except Exception:
                    pass  # its final message is ignored on screen either way
            await self._active.widget.stop_stream()
            self._active.widget = None
        self._end_edit()

    async def _show_state(self, state: ChatState) -> None:
        await self._leave_chat()
        self.state = state
        await self.chat_log.show_chat(state, self.model_name)
        self.sub_title = state.title or "New chat"
        last = next((t.stats for t in reversed(state.turns) if t.stats is not None), None)
        self.status.show_stats(last)
        self.prompt.focus()

    async def action_new_chat(self) -> None:
        await self._show_state(ChatState(model=self.model_name, system_prompt=self.default_system_prompt))
        self.prompt.clear()

    def action_attach(self) -> None:
        self.push_screen(AttachScreen(), self._attach)

    def _attach(self, path: str | None) -> None:
        if path is None:
            return
        try:
            block = read_attachment(path)
        except AttachmentError as e:
            self.notify(str(e), title="Attach", severity="error")
            return
        draft = self.prompt.text.strip("\n")
        self.prompt.set_text(block + "\n\n" + (draft + "\n" if draft else ""))
        self.prompt.focus()

    def action_conversations(self) -> None:
        if not self.recorder.enabled:
            self.notify("History is off, so there are no saved chats.", severity="warning")
            return
        screen = ConversationsScreen(
            self.recorder.conversations(), current=self.state.conv_id, search=self.recorder.search
        )
        self.push_screen(screen, self._resume)

    async def _resume(self, choice: tuple[int, int | None] | None) -> None:
        if choice is None:
            return
        conv_id, msg_id = choice
        conv = self.recorder.load(conv_id)
        if conv is None:
            return
        state = ChatState(conv_id=conv.id, title=conv.title, model=conv.model, system_prompt=conv.system_prompt)
        for m in conv.messages:
            if m.role == "system":  # a system message stored as a message: treat as the prompt
                state.system_prompt = state.system_prompt or m.content
                continue
            stats, tokens, error = stats_from_dict(m.stats)
            state.turns.append(Turn(m.role, m.content, m.id, stats, tokens, error))
        await self._show_state(state)
        self._mark_branches()
        for turn in state.turns:
            if turn.role == "user":
                self.prompt.remember(turn.content)
        if conv.model != self.model_name:
            self.notify(f"This chat was saved with {conv.model}; replies now come from {self.model_name}.")
        found = next((t for t in state.turns if msg_id is not None and t.msg_id == msg_id), None)
        if found is not None and (widget := self.chat_log.widget_for(found)) is not None:
            self.chat_log.reveal(widget)
            widget.focus(scroll_visible=False)  # the found message, ready to read; Tab moves on

    def on_conversations_screen_delete(self, message: ConversationsScreen.Delete) -> None:
        self.recorder.delete(message.conv_id)
        if message.conv_id == self.state.conv_id:
            self.state.conv_id = None
            for turn in self.state.turns:
                turn.msg_id = None
        self.notify("Chat deleted.")

    def on_conversations_screen_export(self, message: ConversationsScreen.Export) -> None:
        self.action_export(message.conv_id)

    def action_system_prompt(self) -> None:
        def done(text: str | None) -> None:
            if text is None or text == self.state.system_prompt:
                return
            self.state.system_prompt = text
            self.default_system_prompt = text
            self.recorder.set_system_prompt(self.state.conv_id, text)
            self.chat_log.set_system_prompt(text)
            self.notify("System prompt set; it applies from the next reply." if text else "System prompt cleared.")

        self.push_screen(SystemPromptScreen(self.state.system_prompt), done)

    def action_toggle_sampling(self) -> None:
        panel = self.panel
        panel.display = not panel.display
        if panel.display:
            panel.focus_first()
        else:
            self.prompt.focus()

    def on_sampling_panel_changed(self, message: SamplingPanel.Changed) -> None:
        self._apply_settings(message.settings)

    def _apply_settings(self, settings: SamplingSettings) -> None:
        """Hand new settings to the engine now (the next token uses them); show the values in force."""
        self.settings = settings
        if self.backend is not None and self.generating and getattr(self.backend, "remote", None) is not None:
            # The request in flight carries its settings; a stream cannot be changed, so say when it applies.
            if self._active is not None and not self._active.told_next_reply:
                self._active.told_next_reply = True
                self.notify("The server already has this reply's settings: the change applies from the next reply.")
        if self.backend is not None:
            try:
                self.backend.settings = settings
            except Exception as exc:
                self.notify(f"Settings not applied: {describe_error(exc)}", severity="error")
            self.settings = self.backend.settings
        self.panel.settings = self.settings

    def _target_reply(self) -> Turn | None:
        """The focused reply, else the last one."""
        if isinstance(self.focused, AssistantMessage):
            return self.focused.turn
        found = self.state.last("assistant")
        return found[1] if found else None

    def action_inspect(self) -> None:
        turn = self._target_reply()
        if turn is None:
            self.notify("No reply to inspect yet.", severity="warning")
            return
        replies = [t for t in self.state.turns if t.role == "assistant"]
        number = next(i for i, t in enumerate(replies, 1) if t is turn)
        model = self.state.model or self.model_name
        title = f"Reply {number} of {len(replies)} · {model} · {len(turn.tokens)} tokens"
        self.push_screen(InspectorScreen(turn, title=title))

    def action_copy_reply(self) -> None:
        turn = self._target_reply()
        if turn is None or not turn.content:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(turn.content)
        self.notify(f"Copied the reply ({len(turn.content):,} characters).")

    def action_copy_code(self, number: int) -> None:
        turn = self._target_reply()
        blocks = code_blocks(turn.content) if turn else []
        if not 1 <= number <= len(blocks):
            self.notify("That code block is not there.", severity="warning")
            return
        self.copy_to_clipboard(blocks[number - 1].code)
        self.notify(f"Copied code block {number} ({blocks[number - 1].label}).")

    def action_export(self, conv_id: int | None = None) -> None:
        """Write the chat as Markdown into `export_dir` and say where."""
        conv_id = conv_id if conv_id is not None else self.state.conv_id
        if conv_id is not None and self.recorder.enabled:
            text = self.recorder.export_markdown(conv_id)
            if text is None:
                return  # the recorder reported why
            title = text.splitlines()[0].lstrip("# ") if text else ""
        elif self.state.turns:
            text, title = to_markdown(self.state), self.state.title
        else:
            self.notify("Nothing to export yet.", severity="warning")
            return
        try:
            path = write_export(self.export_dir, conv_id, title, text)
        except OSError as exc:
            self.notify(f"Couldn't write the export: {exc.strerror or exc}", severity="error")
            return
        self.notify(f"Exported to {path}", title="Export", timeout=10)

    def action_scroll_chat(self, pages: int) -> None:
        """Page through the chat while the message box keeps the focus."""
        log = self.chat_log
        if pages < 0:
            log.release_anchor()
            log.scroll_page_up(animate=False)
        else:
            log.scroll_page_down(animate=False)

    def action_toggle_keys(self) -> None:
        if self.screen.query("KeyPanel"):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def _report_store_problem(self, text: str) -> None:
        self.notify(text, title="Saved chats", severity="error", timeout=10)

    # ---- command palette ------------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Start an empty conversation (ctrl+n)", self.action_new_chat)
        yield SystemCommand("Stop generating", "Stop the reply in progress; keep what came (Esc)", self.action_stop)
        yield SystemCommand(
            "Regenerate reply", "Replace the last reply with a new one (ctrl+r)", self.action_regenerate
        )
        yield SystemCommand(
            "Edit last message", "Change your last message and resend it (ctrl+g)", self.action_edit_last
        )
        yield SystemCommand("Copy reply", "Copy the selected or last reply (ctrl+o)", self.action_copy_reply)
        turn = self._target_reply()
        for n, block in enumerate(code_blocks(turn.content) if turn else [], 1):
            yield SystemCommand(f"Copy code block {n}", f"{block.label}, from the last reply", self._copier(n))
        yield SystemCommand("Sampling settings", "Show or hide the sampling panel (F2)", self.action_toggle_sampling)
        yield SystemCommand("Inspect reply", "Tokens, probabilities and timings of a reply (F3)", self.action_inspect)
        yield SystemCommand(
            "Saved chats", "List, resume, export or delete saved chats (ctrl+l)", self.action_conversations
        )
        yield SystemCommand("System prompt", "Edit the system prompt (ctrl+t)", self.action_system_prompt)
        yield SystemCommand("Switch model", "Load another model; the chat carries over (F10)", self.action_switch_model)
        yield SystemCommand("Attach a file", "Put a text file into the message (F9, or /read PATH)", self.action_attach)
        yield SystemCommand("Export chat as Markdown", f"Write it into {self.export_dir} (F8)", self.action_export)

    def _copier(self, n: int) -> Callable[[], None]:
        return lambda: self.action_copy_code(n)


def run_app(
    backend_factory: Callable[[Callable[[str], None]], ChatBackend],
    *,
    model_name: str,
    settings: SamplingSettings,
    system_prompt: str,
    store_path: Path | None,
    theme: str | None = None,
    model_choices: Callable[[], Sequence[ModelChoice]] | None = None,
    factory_for_model: Callable[[str], BackendFactory] | None = None,
) -> None:
    """Run the chat UI. `backend_factory(progress)` loads the model in a worker thread, reporting progress
    lines through `progress`; `store_path=None` turns history off; the model picker offers `model_choices()`
    and loads one with `factory_for_model(spec)`."""
    from chatapp import paths
    from chatapp.settings import save_user_setting

    store, warning = None, None
    if store_path is not None:
        try:
            from chatapp.store import ConversationStore

            store, warning = ConversationStore.open(store_path, fallback_new=True)
        except Exception as exc:  # history is a convenience; the chat works without it
            warning = f"History is off: {describe_error(exc)}"
    app = ChatApp(
        backend_factory,
        model_name=model_name,
        settings=settings,
        system_prompt=system_prompt,
        store=store,
        store_warning=warning,
        export_dir=paths.user_data_dir() / "exports",
        theme=theme,
        save_theme=lambda name: save_user_setting("theme", name),
        model_choices=model_choices,
        factory_for_model=factory_for_model,
    )
    try:
        app.run()
    finally:
        if store is not None:
            store.close()
