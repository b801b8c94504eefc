"""The chat app driven through Pilot against the scripted fake backend (and a real store in tmp_path)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from textual.widgets import DataTable, Markdown, OptionList, Sparkline, TextArea

from chatapp.chat_state import stats_to_dict
from chatapp.store import ConversationStore
from chatapp.tui.widgets.chat_log import AssistantMessage, Banner, UserMessage
from chatapp.tui.widgets.conversations import ConversationsScreen
from chatapp.tui.widgets.inspector import InspectorScreen
from chatapp.tui.widgets.prompt_input import PromptInput
from chatapp.tui.widgets.sampling_panel import KnobRow, SamplingPanel
from chatapp.tui.widgets.status_bar import StatusBar
from chatapp.tui.widgets.system_prompt import SystemPromptScreen
from engine.events import STOP_CANCELLED, STOP_EOS, Message, TokenEvent, TurnStats
from tests.app.fake_backend import (
    DEMO_REPLY,
    FakeBackend,
    finished,
    make_app,
    ready,
    send,
    split_tokens,
    wait_for,
)

SIZE = (120, 40)


@pytest.fixture
def store(tmp_path: Path):
    store, warning = ConversationStore.open(tmp_path / "chats.sqlite")
    assert warning is None
    yield store
    store.close()


def replies(app) -> list[AssistantMessage]:
    return list(app.query(AssistantMessage))


def text_of(widget) -> str:
    return str(widget.render())


def status_text(app) -> str:
    bar = app.query_one(StatusBar)
    return f"{text_of(bar.query_one('#status-left'))} | {text_of(bar.query_one('#status-right'))}"


# ---- sending and streaming ---------------------------------------------------------------------------------


async def test_send_streams_the_reply_through_a_markdown_stream(store, monkeypatch):
    backend = FakeBackend(["Hello **there**, how are you today?"], gated=True)
    app = make_app(backend, store=store)
    full_updates = []
    original_update = Markdown.update
    monkeypatch.setattr(Markdown, "update", lambda self, md: full_updates.append(md) or original_update(self, md))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi", wait=False)
        await wait_for(pilot, lambda: len(replies(app)) == 1, what="the reply widget")
        assert app.generating
        assert "generating" in status_text(app)

        backend.release(2)
        await wait_for(pilot, lambda: app.state.turns[-1].content == "Hello **there**,", what="two tokens")
        body = replies(app)[0].body
        await wait_for(pilot, lambda: body.source == "Hello **there**,", what="the Markdown to catch up")
        assert "2 tokens" in status_text(app)
        assert "TTFT" in status_text(app)

        backend.release(10)
        await finished(pilot)
        reply = replies(app)[0]
        assert reply.body.source == "Hello **there**, how are you today?"
        assert not any(full_updates), "a streamed reply must be appended, not re-parsed whole"
        meta = text_of(reply.query_one(".meta"))
        assert "decode" in meta and "TTFT 152 ms" in meta and "6 tokens" in meta and "stop: eos" in meta
        assert "cache 0/" in status_text(app) and "ctx " in status_text(app)
    assert backend.calls == [[Message("user", "hi")]]


async def test_messages_are_saved_as_they_happen(store):
    backend = FakeBackend(["one two three four"], gated=True)
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "count to four", wait=False)
        await wait_for(pilot, lambda: app.state.conv_id is not None)
        conv = store.load(app.state.conv_id)
        assert [(m.role, m.content) for m in conv.messages] == [("user", "count to four")]
        assert conv.title == "count to four"

        backend.release(1)
        await wait_for(pilot, lambda: app.state.turns[-1].msg_id is not None, what="the reply's row")
        conv = store.load(app.state.conv_id)
        assert [(m.role, m.content, m.stats) for m in conv.messages][1] == ("assistant", "one", None)

        backend.release(10)
        await finished(pilot)
        saved = store.load(app.state.conv_id).messages[1]
        assert saved.content == "one two three four"
        assert saved.stats["stop_reason"] == STOP_EOS
        assert saved.stats["generated_tokens"] == 4
        assert [t["text"] for t in saved.stats["tokens"]] == ["one", " two", " three", " four"]


async def test_escape_stops_and_keeps_the_partial_reply(store):
    backend = FakeBackend(["a b c d e f g h"], gated=True)
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "letters", wait=False)
        backend.release(3)
        await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) == 3, what="three tokens")
        await pilot.press("escape")
        assert backend.cancel_calls >= 1
        assert "stopping" in status_text(app)
        backend.release(10)
        await finished(pilot)
        reply = app.state.turns[-1]
        assert reply.content == "a b c"
        assert reply.stats.stop_reason == STOP_CANCELLED
        assert replies(app)[0].body.source == "a b c"
        assert "stop: cancelled" in text_of(replies(app)[0].query_one(".meta"))
        saved = store.load(app.state.conv_id).messages[-1]
        assert (saved.content, saved.stats["stop_reason"]) == ("a b c", STOP_CANCELLED)
        # The partial reply is part of the history the next turn sends.
        backend.replies = ["ok"]
        backend.release(5)
        await send(pilot, "go on")
        assert backend.calls[-1][1] == Message("assistant", "a b c")


async def test_a_message_sent_while_generating_is_refused_and_kept(store):
    backend = FakeBackend(["x y z"], gated=True)
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first", wait=False)
        await send(pilot, "second", wait=False)
        assert app.query_one(PromptInput).text == "second"
        assert any("being generated" in n for n in app.notices)
        backend.release(10)
        await finished(pilot)
        assert len(backend.calls) == 1


async def test_regenerate_replaces_the_last_reply(store):
    backend = FakeBackend(["first answer", "second answer"])
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "question")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(backend.calls) == 2)
        await finished(pilot)
        assert [r.body.source for r in replies(app)] == ["second answer"]
        assert backend.calls[1] == backend.calls[0] == [Message("user", "question")]
        conv = store.load(app.state.conv_id)
        assert [(m.role, m.content) for m in conv.messages] == [("user", "question"), ("assistant", "second answer")]


async def test_edit_last_message_and_resend(store):
    backend = FakeBackend(["reply one", "reply two", "reply three"])
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first")
        await send(pilot, "secnod")
        await pilot.press("ctrl+g")
        prompt = app.query_one(PromptInput)
        assert prompt.text == "secnod" and app.editing
        assert list(app.query(UserMessage))[-1].has_class("-editing")
        prompt.set_text("second")
        await pilot.press("enter")
        await finished(pilot)
        assert not app.editing
        assert [u.turn.content for u in app.query(UserMessage)] == ["first", "second"]
        assert backend.calls[-1] == [
            Message("user", "first"),
            Message("assistant", "reply one"),
            Message("user", "second"),
        ]
        conv = store.load(app.state.conv_id)
        assert [m.content for m in conv.messages] == ["first", "reply one", "second", "reply three"]


async def test_escape_cancels_an_edit():
    app = make_app(FakeBackend(["r"]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        await pilot.press("ctrl+g")
        assert app.editing
        await pilot.press("escape")
        assert not app.editing
        assert app.query_one(PromptInput).text == ""
        assert not list(app.query(UserMessage))[-1].has_class("-editing")


async def test_new_chat_starts_empty_and_saves_separately(store):
    backend = FakeBackend(["answer"])
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "one")
        first = app.state.conv_id
        await pilot.press("ctrl+n")
        assert not replies(app) and not list(app.query(UserMessage))
        assert app.query_one(Banner).display
        assert app.state.conv_id is None
        await send(pilot, "two")
        assert backend.calls[-1] == [Message("user", "two")]
        assert app.state.conv_id not in (None, first)
        assert len(store.list()) == 2


async def test_new_chat_while_generating_stops_and_still_saves(store):
    backend = FakeBackend(["p q r s t"], gated=True)
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "long one", wait=False)
        backend.release(2)
        await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) == 2)
        old = app.state.conv_id
        await pilot.press("ctrl+n")
        assert backend.cancel_calls >= 1 and not replies(app)
        backend.release(5)
        await finished(pilot)
        assert not replies(app), "the old reply's end must not appear in the new chat"
        assert store.load(old).messages[-1].content == "p q"


# ---- sampling panel ----------------------------------------------------------------------------------------


async def test_sampling_change_mid_reply_reaches_the_backend_before_the_next_token():
    backend = FakeBackend(["t0 t1 t2 t3 t4"], gated=True)
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go", wait=False)
        backend.release(2)
        await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) == 2)
        await pilot.press("f2")
        assert isinstance(app.focused, KnobRow) and app.focused.knob.name == "temperature"
        await pilot.press("right")
        await pilot.pause()
        assert backend.settings.temperature == pytest.approx(0.85)
        backend.release(10)
        await finished(pilot)
        temps = [s.temperature for s in backend.seen_settings]
        assert temps == pytest.approx([0.8, 0.8, 0.85, 0.85, 0.85])
        row = app.query_one("#knob-temperature", KnobRow)
        assert text_of(row.query_one(".knob-value")) == "0.85"


async def test_sampling_panel_keys_mouse_and_typed_values():
    backend = FakeBackend()
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        panel = app.query_one(SamplingPanel)
        assert panel.display
        await pilot.press("shift+right")  # temperature +0.5
        assert backend.settings.temperature == pytest.approx(1.3)
        await pilot.press("down", "left")  # no: down is not bound; tab moves between rows
        await pilot.press("tab", "minus", "minus")  # top-k 40 -> 38
        assert backend.settings.top_k == 38
        await pilot.click("#knob-top_p .knob-dec")
        assert backend.settings.top_p == pytest.approx(0.94)
        # Typing a value: out of range is clamped, and the panel shows what is in force.
        await pilot.click("#knob-temperature .knob-value")
        await pilot.press("ctrl+a", "9", "enter")
        await pilot.pause()
        assert backend.settings.temperature == 5.0
        assert text_of(app.query_one("#knob-temperature .knob-value")) == "5.00"
        assert any("out of range" in n for n in app.notices)
        # Nonsense is refused with a notice and changes nothing.
        await pilot.click("#knob-seed .knob-value")
        await pilot.press("ctrl+a", *"abc", "enter")
        assert backend.settings.seed == -1
        assert any("not a valid value" in n for n in app.notices)
        await pilot.press("escape")
        # Seed: stepping up from "random" fixes a seed; stepping down returns to random.
        app.query_one("#knob-seed", KnobRow).focus()
        await pilot.press("right")
        assert backend.settings.seed == 0
        await pilot.press("left")
        assert backend.settings.seed == -1
        # max_tokens is capped by the context size.
        app.query_one("#knob-max_tokens", KnobRow).focus()
        await pilot.press("enter", "ctrl+a", *"99999", "enter")
        await pilot.pause()
        assert backend.settings.max_tokens == backend.n_ctx
        await pilot.press("r")
        assert backend.settings == app.query_one(SamplingPanel).defaults
        await pilot.press("f2")
        assert not panel.display and isinstance(app.focused, PromptInput)


async def test_quick_repeated_changes_all_land():
    """Key repeat and quick changes to two rows: each step builds on the last, before any is applied."""
    backend = FakeBackend()
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        temperature, top_k = app.query_one("#knob-temperature", KnobRow), app.query_one("#knob-top_k", KnobRow)
        temperature.adjust(-1)
        temperature.adjust(-1)
        top_k.adjust(1)
        await pilot.pause()
        assert (backend.settings.temperature, backend.settings.top_k) == (pytest.approx(0.7), 41)


async def test_settings_changed_while_loading_are_applied_at_load():
    backend = FakeBackend()
    gate = threading.Event()
    app = make_app(backend)

    def slow_factory(progress):
        progress("loading weights 40%")
        assert gate.wait(10)
        return backend

    app.backend_factory = slow_factory
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "loading weights 40%" in text_of(app.query_one(Banner)))
        assert "loading" in status_text(app)
        await pilot.press("f2", "left")
        gate.set()
        await ready(pilot)
        assert backend.settings.temperature == pytest.approx(0.75)


# ---- inspector ---------------------------------------------------------------------------------------------


async def test_inspector_shows_one_row_per_token():
    backend = FakeBackend([DEMO_REPLY])
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "reverse a string")
        await pilot.press("f3")
        screen = app.screen
        assert isinstance(screen, InspectorScreen)
        n = len(split_tokens(DEMO_REPLY))
        table = screen.query_one("#tokens", DataTable)
        assert table.row_count == n == len(app.state.turns[-1].tokens)
        first = [str(c) for c in table.get_row_at(0)]
        assert first[1] == "'Here'" and first[2] == "1000" and first[3] == "150.5 prefill" and first[4] == "0.970"
        assert "' the' 0.02" in first[5]
        assert len(screen.query_one(Sparkline).data) == n - 1  # decode steps only; prefill shown apart
        bars = text_of(screen.query_one("#phase-bars"))
        assert "Prefill" in bars and "Decode" in bars and "150 ms" in bars
        prob = screen.query_one("#prob-box")
        assert not prob.display
        await pilot.press("p")
        assert prob.display
        await pilot.press("escape")
        assert not isinstance(app.screen, InspectorScreen)


async def test_inspect_the_focused_reply():
    app = make_app(FakeBackend(["one", "two words"]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "a")
        await send(pilot, "b")
        replies(app)[0].focus()
        await pilot.press("i")
        assert isinstance(app.screen, InspectorScreen)
        assert app.screen.heading.startswith("Reply 1 of 2")
        assert app.screen.query_one("#tokens", DataTable).row_count == 1


# ---- saved chats -------------------------------------------------------------------------------------------


def saved_conversation(store: ConversationStore) -> int:
    conv = store.create("Earlier chat", "fake-7b-q4_0", system_prompt="Be terse.")
    store.add_message(conv, "user", "What is 2+2?")
    tokens = [TokenEvent(5, "4", 150.0, 0.5, 0.9, (), 0), TokenEvent(6, ".", 20.0, 0.5, 0.8, (), 1)]
    stats = TurnStats(12, 0, 12, 150.0, 152.0, 20.5, 2, STOP_EOS, 14, 2048, reply="4.")
    store.add_message(conv, "assistant", "4.", stats_to_dict(stats, tokens))
    return conv


async def test_resume_a_saved_conversation(store):
    conv = saved_conversation(store)
    store.create("Another", "other-model")
    backend = FakeBackend(["Five."])
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")
        screen = app.screen
        assert isinstance(screen, ConversationsScreen)
        options = screen.query_one(OptionList)
        assert options.option_count == 2
        assert options.highlighted == 0
        await pilot.press("down")  # "Another" is newer, so it is listed first
        assert options.highlighted == 1
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.state.conv_id == conv)
        await pilot.pause()
        assert [u.turn.content for u in app.query(UserMessage)] == ["What is 2+2?"]
        assert [r.body.source for r in replies(app)] == ["4."]
        assert app.state.system_prompt == "Be terse."
        assert "stop: eos" in text_of(replies(app)[0].query_one(".meta"))
        await pilot.press("f3")
        assert app.screen.query_one("#tokens", DataTable).row_count == 2
        await pilot.press("escape")
        await send(pilot, "And 2+3?")
        assert backend.calls[-1] == [
            Message("system", "Be terse."),
            Message("user", "What is 2+2?"),
            Message("assistant", "4."),
            Message("user", "And 2+3?"),
        ]
        assert [m.content for m in store.load(conv).messages][-2:] == ["And 2+3?", "Five."]
        # The resumed chat's messages are in the input history.
        prompt = app.query_one(PromptInput)
        prompt.focus()
        await pilot.press("up")
        assert prompt.text == "And 2+3?"
        await pilot.press("up")
        assert prompt.text == "What is 2+2?"


async def test_conversation_list_filters_and_deletes(store):
    saved_conversation(store)
    store.create("Python questions", "fake-7b-q4_0")
    app = make_app(FakeBackend(), store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")
        screen = app.screen
        screen.query_one("#conv-filter").focus()
        await pilot.press(*"python")
        assert screen.query_one(OptionList).option_count == 1
        await pilot.press("enter", "d")
        assert len(store.list()) == 2, "the first press only arms the delete"
        await pilot.press("d")
        await pilot.pause()
        assert [s.title for s in store.list()] == ["Earlier chat"]
        assert screen.query_one(OptionList).option_count == 0
        await pilot.press("escape")
        assert not isinstance(app.screen, ConversationsScreen)


async def test_export_markdown(store, tmp_path):
    app = make_app(FakeBackend(["Sure: `x`"]), store=store, export_dir=tmp_path / "exports")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Export me")
        await pilot.press("f8")
        files = list((tmp_path / "exports").glob("*.md"))
        assert len(files) == 1 and files[0].name == f"chat-{app.state.conv_id}-export-me.md"
        text = files[0].read_text()
        assert "Export me" in text and "Sure: `x`" in text and "## Assistant" in text
        assert any(str(files[0]) in n for n in app.notices)


async def test_export_without_a_store_uses_the_screen(tmp_path):
    app = make_app(FakeBackend(["fine"]), export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "no history")
        app.action_export()
        (path,) = tmp_path.glob("chat-unsaved-*.md")
        assert "no history" in path.read_text() and "fine" in path.read_text()


# ---- the rest of the actions -------------------------------------------------------------------------------


async def test_copy_reply_and_code_blocks():
    app = make_app(FakeBackend([DEMO_REPLY]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "code please")
        await pilot.press("ctrl+o")
        assert app.clipboard == DEMO_REPLY
        titles = {c.title: c for c in app.get_system_commands(app.screen)}
        titles["Copy code block 1"].callback()
        assert app.clipboard == "def reverse(text: str) -> str:\n    return text[::-1]\n"
        replies(app)[0].focus()
        await pilot.press("b")
        assert app.clipboard.startswith("def reverse")


async def test_command_palette_has_every_action():
    app = make_app(FakeBackend())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        titles = {c.title for c in app.get_system_commands(app.screen)}
    assert {
        "New chat",
        "Stop generating",
        "Regenerate reply",
        "Edit last message",
        "Copy reply",
        "Sampling settings",
        "Inspect reply",
        "Saved chats",
        "System prompt",
        "Export chat as Markdown",
    } <= titles


async def test_system_prompt_editor(store):
    backend = FakeBackend(["ok"])
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await pilot.press("ctrl+t")
        assert isinstance(app.screen, SystemPromptScreen)
        app.screen.query_one(TextArea).load_text("Answer in French.")
        await pilot.press("ctrl+s")
        assert not isinstance(app.screen, SystemPromptScreen)
        assert app.state.system_prompt == "Answer in French."
        assert store.load(app.state.conv_id).system_prompt == "Answer in French."
        assert app.query_one("#system-card").display
        await send(pilot, "again")
        assert backend.calls[-1][0] == Message("system", "Answer in French.")
        await pilot.press("ctrl+n")
        await send(pilot, "new chat")
        assert backend.calls[-1][0] == Message("system", "Answer in French."), "new chats keep it"


async def test_input_newline_and_history():
    app = make_app(FakeBackend(["r"]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.query_one(PromptInput)
        await pilot.press(*"line one", "ctrl+j", *"line two")
        assert prompt.text == "line one\nline two"
        await pilot.press("enter")
        await finished(pilot)
        assert app.state.turns[0].content == "line one\nline two" and prompt.text == ""
        await send(pilot, "short")
        await pilot.press(*"draft")
        await pilot.press("up")
        assert prompt.text == "short"
        await pilot.press("up")
        assert prompt.text == "line one\nline two"
        await pilot.press("up")  # cursor is on the last line: moves within the text
        assert prompt.cursor_location[0] == 0
        await pilot.press("down", "down")
        assert prompt.text == "short"
        await pilot.press("down")
        assert prompt.text == "draft"


# ---- failures never reach the user as tracebacks ------------------------------------------------------------


async def test_engine_failure_becomes_a_notice_and_the_app_goes_on(store):
    backend = FakeBackend(["will break here", "works now"], fail_calls=[1], fail_after=2)
    app = make_app(backend, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "try")
        reply = replies(app)[0]
        assert reply.has_class("-failed")
        assert "generation failed: RuntimeError: scripted failure" in text_of(reply.query_one(".meta"))
        assert any("scripted failure" in n for n in app.notices)
        assert reply.body.source == "will break"
        saved = store.load(app.state.conv_id).messages[-1]
        assert saved.content == "will break" and "scripted failure" in saved.stats["error"]
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(backend.calls) == 2)
        await finished(pilot)
        assert [r.body.source for r in replies(app)] == ["works now"]


async def test_load_failure_keeps_the_app_usable(store):
    saved_conversation(store)
    app = make_app(FakeBackend(), store=store, fail_load="model.gguf: tensor blk.0.attn_q.weight is missing")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "failed" in status_text(app))
        assert "blk.0.attn_q.weight is missing" in text_of(app.query_one(Banner))
        assert any("blk.0.attn_q.weight" in n for n in app.notices)
        await send(pilot, "hello?", wait=False)
        assert any(n.startswith("No model") for n in app.notices)
        assert app.query_one(PromptInput).text == "hello?"
        await pilot.press("ctrl+l", "enter")
        await wait_for(pilot, lambda: app.state.conv_id is not None)
        assert [r.body.source for r in replies(app)] == ["4."]


async def test_engine_warnings_are_notified_once():
    backend = FakeBackend(["a", "b"], warnings=["chat template fell back to ChatML"], turn_warnings=["shifted"])
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.notices.count("chat template fell back to ChatML") == 1
        await send(pilot, "one")
        await send(pilot, "two")
        assert app.notices.count("shifted") == 1
        assert app.notices.count("chat template fell back to ChatML") == 1


async def test_a_broken_store_does_not_stop_the_chat():
    class BrokenStore:
        def create(self, *args):
            raise OSError("disk full")

        def list(self, limit=200):
            return []

    app = make_app(FakeBackend(["still here"]), store=BrokenStore())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        assert [r.body.source for r in replies(app)] == ["still here"]
        assert app.notices.count("Couldn't save the chat: disk full") == 1


async def test_quitting_mid_reply_stops_the_engine():
    backend = FakeBackend(["a b c d"], gated=True)
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "x", wait=False)
        backend.release(1)
        await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) == 1)
        assert backend.cancel_calls == 0
    assert backend.cancel_calls >= 1
    backend.release(10)  # let the worker thread see the cancel and end


async def test_keys_panel_and_system_card_click():
    app = make_app(FakeBackend(["ok"]), system_prompt="Be kind.")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        assert app.screen.query("KeyPanel")
        await pilot.press("f1")
        assert not app.screen.query("KeyPanel")
        await send(pilot, "hello")
        assert app.query_one("#system-card").display
        await pilot.click("#system-card")
        assert isinstance(app.screen, SystemPromptScreen)
        await pilot.press("escape")
        assert app.state.system_prompt == "Be kind."


async def test_the_chat_pages_while_typing():
    app = make_app(FakeBackend(["\n\n".join(f"paragraph {i}" for i in range(40))]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "long please")
        log = app.query_one("#chat-log")
        await wait_for(pilot, lambda: log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y)
        await pilot.press("ctrl+up")
        assert log.scroll_y < log.max_scroll_y and isinstance(app.focused, PromptInput)
        await pilot.press("ctrl+down", "ctrl+down", "ctrl+down", "ctrl+down")
        assert log.scroll_y == log.max_scroll_y
