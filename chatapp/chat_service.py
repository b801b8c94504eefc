"""The conversation's life, outside any UI: sending, a reply from start to stop, saving, branches, export.

`ChatService` is plain Python: the TUI (`chatapp.tui.app`) and `chatapp run --chat` drive the same one, and the
tests drive it with no screen at all. It never runs inference itself; whoever owns the inference thread calls
`generate_reply(...)` there and hands each token and the ending back on the thread that owns the service
(the TUI's worker posts them as messages; `chatapp run` does it all on one thread). A reply is matched by
its `turn` number, so a token from a reply the user has left behind (new chat, resumed chat) is still
saved but reported as not shown.

A request the service declines (a reply in flight, no model yet) raises `Refused`, whose text is for the user.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from chatapp.backend import ChatBackend
from chatapp.chat_state import ChatState, LiveMetrics, ToolRecord, ToolRound, Turn
from chatapp.errors import describe_error
from chatapp.export import transcript, write_export
from chatapp.recorder import Recorder
from chatapp.store import suggest_title
from engine.events import GrammarSpec, Message, TokenEvent, TurnStats
from engine.sampling import SamplingSettings


class Refused(Exception):
    """What the user asked for cannot happen now; `str(self)` says why, `severity` how loudly."""

    def __init__(self, text: str, severity: str = "warning") -> None:
        super().__init__(text)
        self.severity = severity


class ReplyError(Exception):
    """The engine failed mid-reply; the message is one line fit for the user."""


@dataclass
class ActiveReply:
    """The reply being generated. Outlives the chat on screen if the user leaves it: it is still saved."""

    turn: int  # matches the inference thread's reports to this reply
    reply: Turn
    conv_id: int | None
    messages: list[Message]  # what the backend was asked to answer
    metrics: LiveMetrics = field(default_factory=LiveMetrics)
    stop: threading.Event = field(default_factory=threading.Event)  # set when the user asked to stop
    shown: bool = True  # False once the chat on screen is another one
    told_next_reply: bool = False  # remote: the user was told a settings change waits for the next reply
    constraint: GrammarSpec | None = None  # the reply format in force when it started


class Replier(Protocol):
    """What `generate_reply` needs of a backend: a ChatBackend, or one with this round's tools (chatapp.mcp)."""

    def stream_reply(self, messages: Sequence[Message]) -> Iterator[TokenEvent | TurnStats]: ...
    def cancel(self) -> None: ...


def generate_reply(
    backend: Replier,
    messages: Sequence[Message],
    on_token: Callable[[TokenEvent, float], object],
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TurnStats:
    """Run one reply on the calling (inference) thread: `on_token(event, elapsed_ms)` per token, then its stats.

    Any engine failure is raised as `ReplyError`. The UI calls `backend.cancel()` itself and sets `stop`;
    should that cancel have landed before `stream_reply` started (and been forgotten by it), the next token
    repeats it from here.
    """
    start = clock()
    repeated = False
    try:
        for event in backend.stream_reply(messages):
            if isinstance(event, TokenEvent):
                on_token(event, (clock() - start) * 1000.0)
                if stop is not None and stop.is_set() and not repeated:
                    repeated = True
                    backend.cancel()
            elif isinstance(event, TurnStats):
                return event
    except Exception as exc:  # any engine failure becomes one line, never a traceback
        raise ReplyError(describe_error(exc)) from exc
    raise ReplyError("the engine ended the reply without its statistics")


class ChatService:
    """One conversation at a time, its replies, and the saved chats behind it. Call from one thread only."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        model_name: str,
        settings: SamplingSettings,
        system_prompt: str = "",
        backend: ChatBackend | None = None,
        reply_format: GrammarSpec | None = None,
    ) -> None:
        self.recorder = recorder
        self.model_name = model_name
        """The model replies come from (or will, once loaded)."""
        self.settings = settings
        """The sampling settings the user chose (pushed to the backend as soon as there is one)."""
        self.default_system_prompt = system_prompt
        """What a new chat starts with; the last system prompt the user set."""
        self.state = ChatState(model=model_name, system_prompt=system_prompt)
        """The chat on screen."""
        self.backend: ChatBackend | None = None
        """Set when the model has loaded; None while loading or after a failed load."""
        self.load_error: str | None = None
        self.switching: str | None = None
        """The model being loaded in place of the current one (which stays in use meanwhile)."""
        self.active: ActiveReply | None = None
        self.reply_format = reply_format
        """The JSON schema or grammar every reply must match, from the next one on; None: free text."""
        self._turn = 0
        self._shown_warnings: set[str] = set()
        if backend is not None:
            self.model_ready(backend)

    @property
    def generating(self) -> bool:
        return self.active is not None

    # ---- the model ------------------------------------------------------------------------------------

    def begin_switch(self, spec: str) -> None:
        if self.generating or self.switching is not None:
            raise Refused("Wait for the reply (Esc stops it) or the load in progress.")
        self.switching = spec

    def model_ready(self, backend: ChatBackend) -> str | None:
        """The model has loaded; the previous model's spec when this was a switch, else None."""
        switched, self.switching = self.switching, None
        if switched is not None:
            self._shown_warnings.clear()  # the new model's warnings are news
        self.backend = backend
        self.load_error = None
        self.model_name = backend.model_name or self.model_name
        if not self.state.turns or switched is not None:  # begun before the name was known, or carried over
            self.state.model = self.model_name
        return switched

    def sync_settings(self) -> str | None:
        """After a load: hand the backend the settings changed while it loaded (see `apply_settings`)."""
        if self.backend is None or self.backend.settings == self.settings:
            if self.backend is not None:
                self.settings = self.backend.settings
            return None
        return self.apply_settings(self.settings)

    def model_failed(self, error: str) -> str | None:
        """A load failed: the spec that failed when the old model stays in use, else None (no model now)."""
        failed, self.switching = self.switching, None
        if failed is not None and self.backend is not None:
            return failed
        self.load_error = error
        return None

    def new_warnings(self, extra: Iterable[str] = ()) -> list[str]:
        """Engine warnings not yet told this session (each is told once)."""
        found = list(extra)
        if self.backend is not None:
            try:
                found += list(self.backend.warnings())
            except Exception as exc:  # warnings are advisory; never fail over them
                found.append(f"could not read the engine's warnings: {describe_error(exc)}")
        news = [text for text in dict.fromkeys(found) if text not in self._shown_warnings]
        self._shown_warnings.update(news)
        return news

    def check_ready(self) -> None:
        """Raise `Refused` unless a reply may start now."""
        if self.backend is None:
            if self.load_error is not None:
                raise Refused(f"No model: {self.load_error}", "error")
            raise Refused("The model is still loading…")
        if self.generating:
            raise Refused("A reply is being generated: Esc stops it, then send again.")
        if self.switching is not None:
            raise Refused(f"Loading {self.switching}; send when it is ready.")

    def apply_settings(self, settings: SamplingSettings) -> str | None:
        """Hand new settings to the engine now (the next token uses them); a note for the user, if any.

        `self.settings` is then what is in force. Raises `Refused` when the backend would not take them.
        """
        self.settings = settings
        if self.backend is None:
            return None
        note = None
        active = self.active
        if active is not None and self.backend.remote is not None and not active.told_next_reply:
            # The request in flight carries its settings; a stream cannot be changed, so say when it applies.
            active.told_next_reply = True
            note = "The server already has this reply's settings: the change applies from the next reply."
        try:
            self.backend.settings = settings
        except Exception as exc:
            self.settings = self.backend.settings
            raise Refused(f"Settings not applied: {describe_error(exc)}", "error") from None
        self.settings = self.backend.settings
        return note

    def set_reply_format(self, spec: GrammarSpec | None) -> None:
        """Hold the replies from the next one on to `spec` (None: free text); `Refused` when the model cannot
        compile it, and the format in force stays."""
        from chatapp.reply_format import FormatError, check_format

        if spec is not None:
            try:
                check_format(self.backend, spec)
            except FormatError as e:
                raise Refused(f"Reply format not set: {e}", "error") from None
        self.reply_format = spec

    def check_reply_format(self) -> str | None:
        """After a load: why the model cannot use the reply format (which is then cleared), else None."""
        from chatapp.reply_format import FormatError, check_format

        if self.reply_format is None:
            return None
        try:
            check_format(self.backend, self.reply_format)
        except FormatError as e:
            self.reply_format = None
            return f"Reply format cleared: {e}"
        return None

    # ---- a reply --------------------------------------------------------------------------------------

    def send(self, text: str) -> Turn:
        """Add the user's message to the chat (and the store); `start_reply` asks for the answer."""
        self.check_ready()
        turn = Turn("user", text)
        self.state.turns.append(turn)
        self.state.title = self.state.title or suggest_title(text)
        self.recorder.add_user(self.state, turn)
        return turn

    def start_reply(self) -> ActiveReply:
        """A new, empty reply to the chat as it stands; run `generate_reply` on `active.messages` for it."""
        messages = self.state.backend_messages()
        reply = Turn("assistant", "")
        self.state.turns.append(reply)
        self._turn += 1
        self.active = ActiveReply(self._turn, reply, self.state.conv_id, messages, constraint=self.reply_format)
        return self.active

    def ask(
        self,
        text: str,
        on_text: Callable[[str], None],
        tools: Any | None = None,
        on_call: Callable[[ToolRecord], None] | None = None,
        approve: Callable[[ToolRecord], str] | None = None,
    ) -> Turn:
        """Send `text` and generate the reply here, on the calling thread (`chatapp run --chat`); `on_text` gets
        each token's text. With `tools` (a `chatapp.mcp.loop.ToolChat`), approved calls run and the model goes
        on: `on_call` sees each call's progress, `approve` answers "once", "always" or "deny".
        The finished reply (saved, with its stats); a failure is raised as `ReplyError`."""
        from chatapp.mcp.loop import reply_with_tools
        from chatapp.reply_format import constrained

        self.send(text)
        active = self.start_reply()
        assert self.backend is not None
        service = self

        class Sink:
            def token(self, event: TokenEvent, elapsed_ms: float) -> None:
                service.token(active.turn, event, elapsed_ms)
                on_text(event.text)

            def round_ended(self, text: str, stats: TurnStats) -> None:
                service.round_ended(active.turn, text, stats)

            def call_updated(self, record: ToolRecord) -> None:
                service.call_updated(active.turn, record)
                if on_call is not None:
                    on_call(record)

            def approve(self, record: ToolRecord) -> str:
                return approve(record) if approve is not None else "deny"

        try:
            backend = constrained(self.backend, active.constraint)
            stats = reply_with_tools(backend, active.messages, tools, Sink(), active.stop)
        except ReplyError as exc:
            self.failed(active.turn, str(exc))
            raise
        self.finished(active.turn, stats)
        return active.reply

    def current(self, turn: int) -> ActiveReply | None:
        """The reply in flight if `turn` is its number (a late report of an ended reply gives None)."""
        active = self.active
        return active if active is not None and active.turn == turn else None

    def token(self, turn: int, event: TokenEvent, elapsed_ms: float) -> ActiveReply | None:
        active = self.current(turn)
        if active is not None:
            active.reply.tokens.append(event)
            active.reply.content += event.text
            active.metrics.add(event, elapsed_ms)
            self.recorder.reply_progress(active.conv_id, active.reply)
        return active

    def round_ended(self, turn: int, text: str, stats: TurnStats) -> ActiveReply | None:
        """The model called tools: its text so far becomes the round's, and the reply's text starts again."""
        active = self.current(turn)
        if active is not None:
            active.reply.rounds.append(ToolRound(text))
            active.reply.gen_ms += stats.ttft_ms + stats.decode_ms
            active.reply.content = ""
        return active

    def call_updated(self, turn: int, record: ToolRecord) -> ActiveReply | None:
        """A call of the current round appeared, runs, or has its result (saved once it has one)."""
        active = self.current(turn)
        if active is not None and active.reply.rounds:
            calls = active.reply.rounds[-1].calls
            at = next((i for i, c in enumerate(calls) if c.id == record.id), None)
            if at is None:
                calls.append(record)
            else:
                calls[at] = record
        return active

    def finished(self, turn: int, stats: TurnStats) -> ActiveReply | None:
        active = self.current(turn)
        if active is not None:
            self.active = None
            if active.reply.rounds:
                active.reply.gen_ms += stats.ttft_ms + stats.decode_ms
            active.reply.stats = stats
            if stats.reply:
                active.reply.content = stats.reply
            self.recorder.reply_done(active.conv_id, active.reply)
        return active

    def failed(self, turn: int, error: str) -> ActiveReply | None:
        active = self.current(turn)
        if active is not None:
            self.active = None
            active.reply.error = error
            self.recorder.reply_done(active.conv_id, active.reply)
        return active

    def stop(self) -> bool:
        """Ask the engine to stop after the current token; the partial reply stays. False: nothing to stop.

        A backend whose cancel fails raises `Refused`."""
        if self.backend is None or self.active is None:
            return False
        self.active.stop.set()
        try:
            self.backend.cancel()
        except Exception as exc:
            raise Refused(f"Couldn't stop the reply: {describe_error(exc)}", "error") from None
        return True

    def leave(self) -> ActiveReply | None:
        """Another chat goes on screen: stop the reply in flight, which is still saved when it ends."""
        active = self.active
        if active is None or not active.shown:
            return None
        active.shown = False
        self._cancel_quietly(active)
        return active

    def shutdown(self) -> None:
        """Quitting mid-reply: stop the engine (or the process waits for the last token), and save the reply
        as far as it came (progress saves lag by up to the recorder's interval)."""
        active = self.active
        if active is not None:
            self._cancel_quietly(active)
            self.recorder.reply_done(active.conv_id, active.reply)

    def _cancel_quietly(self, active: ActiveReply) -> None:
        active.stop.set()
        if self.backend is not None:
            try:
                self.backend.cancel()
            except Exception:
                pass  # its ending is only saved, never shown, either way

    # ---- branches -------------------------------------------------------------------------------------

    def drop_from(self, index: int) -> list[Turn]:
        """Take turns[index:] out of the chat (regenerate, edit) and return them; in the store they stay, as
        another branch, and what comes next starts a new one from the turn before."""
        doomed = self.state.turns[index:]
        keep = self.state.saved_id_before(index)
        del self.state.turns[index:]
        self.recorder.branch_at(self.state.conv_id, keep)
        return doomed

    def regenerate(self, user_index: int) -> tuple[list[Turn], ActiveReply]:
        """A new reply to the user message at `user_index`; the replies after it become another branch."""
        self.check_ready()
        doomed = self.drop_from(user_index + 1)
        return doomed, self.start_reply()

    def edit(self, index: int, text: str) -> tuple[list[Turn], Turn]:
        """Replace the user message at `index` with `text` on a new branch; `start_reply` answers it."""
        self.check_ready()
        doomed = self.drop_from(index)
        return doomed, self.send(text)

    def versions(self, turn: Turn) -> list[int]:
        """The saved ids of `turn` and its other versions (other branches from the same point), oldest first."""
        return self.recorder.siblings(turn.msg_id)

    def branch_marks(self) -> list[tuple[Turn, str]]:
        """Each turn with its place among its versions, "‹ 2/3 ›", or "" when it has no other version."""
        marks = []
        for turn in self.state.turns:
            versions = self.versions(turn)
            at = versions.index(turn.msg_id) + 1 if turn.msg_id in versions else 0
            marks.append((turn, f"‹ {at}/{len(versions)} ›" if len(versions) > 1 else ""))
        return marks

    def other_version(self, turn: Turn, step: int) -> ChatState | None:
        """Show the previous (-1) or next (+1) version of `turn` and the branch after it; the new chat state,
        or None if the store could not switch."""
        if self.generating:
            raise Refused("A reply is being generated: Esc stops it first.")
        versions = self.versions(turn)
        conv_id = self.state.conv_id
        if conv_id is None or len(versions) < 2 or turn.msg_id not in versions:
            raise Refused("This message has no other version.")
        target = versions[(versions.index(turn.msg_id) + step) % len(versions)]
        if not self.recorder.switch_branch(conv_id, target):
            return None
        return self.resume(conv_id)

    # ---- chats ----------------------------------------------------------------------------------------

    def new_chat(self) -> ChatState:
        self.leave()
        self.state = ChatState(model=self.model_name, system_prompt=self.default_system_prompt)
        return self.state

    def resume(self, conv_id: int) -> ChatState | None:
        """Put a saved chat on screen (its current branch); None if it could not be read (already reported)."""
        conv = self.recorder.load(conv_id)
        if conv is None:
            return None
        self.leave()
        self.state = ChatState.from_stored(conv)
        return self.state

    def delete(self, conv_id: int) -> None:
        """Delete a saved chat; the one on screen stays on screen, unsaved from now on."""
        self.recorder.delete(conv_id)
        if conv_id == self.state.conv_id:
            self.state.conv_id = None
            for turn in self.state.turns:
                turn.msg_id = None

    def set_system_prompt(self, text: str) -> bool:
        """The system prompt for this chat and new ones; False when it is unchanged."""
        if text == self.state.system_prompt:
            return False
        self.state.system_prompt = self.default_system_prompt = text
        self.recorder.set_system_prompt(self.state.conv_id, text)
        return True

    def last_stats(self) -> TurnStats | None:
        """The stats of the chat's last finished reply (what the status line shows)."""
        return next((t.stats for t in reversed(self.state.turns) if t.stats is not None), None)

    # ---- export ---------------------------------------------------------------------------------------

    def export(self, directory: Path, conv_id: int | None = None) -> Path | None:
        """Write a chat (this one unless `conv_id`) as Markdown into `directory`; its path, or None when the
        store failed (and said so). The saved tree when there is one, else the chat as it stands."""
        conv_id = conv_id if conv_id is not None else self.state.conv_id
        if conv_id is not None and self.recorder.enabled:
            text = self.recorder.export_markdown(conv_id)
            if text is None:
                return None
            title = text.splitlines()[0].lstrip("# ") if text else ""
        elif self.state.turns:
            text, title = transcript(self.state), self.state.title
        else:
            raise Refused("Nothing to export yet.")
        try:
            return write_export(directory, conv_id, title, text)
        except OSError as exc:
            raise Refused(f"Couldn't write the export: {exc.strerror or exc}", "error") from None


def open_store(path: Path | None) -> tuple[Any | None, str | None]:
    """The conversation store at `path` (None: history off) and a warning for the user, if any."""
    if path is None:
        return None, None
    try:
        from chatapp.store import ConversationStore

        return ConversationStore.open(path, fallback_new=True)
    except Exception as exc:  # history is a convenience; the chat works without it
        return None, f"History is off: {describe_error(exc)}"
