"""Snapshots of the main screen, the sampling panel and the inspector (fake backend: fixed text and timings).

Update after an intended change with `pytest tests/app/test_tui_snapshots.py --snapshot-update` and look at the
SVGs in __snapshots__/ before committing them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatapp.store import ConversationStore
from chatapp.tui.widgets.prompt_input import PromptInput
from tests.app.fake_backend import DEMO_REPLY, FakeBackend, make_app, ready, send

SIZE = (120, 40)


@pytest.fixture
def store(tmp_path: Path):
    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    yield store
    store.close()


async def _chat(pilot) -> None:
    await ready(pilot)
    pilot.app.query_one(PromptInput).cursor_blink = False
    await send(pilot, "How do I reverse a string in Python?")
    await pilot.pause()


def test_main_screen(snap_compare, store):
    app = make_app(FakeBackend([DEMO_REPLY]), store=store)
    assert snap_compare(app, terminal_size=SIZE, run_before=_chat)


def test_empty_chat_when_ready(snap_compare, store):
    app = make_app(FakeBackend(), store=store)

    async def run_before(pilot) -> None:
        await ready(pilot)
        pilot.app.query_one(PromptInput).cursor_blink = False
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_sampling_panel(snap_compare, store):
    app = make_app(FakeBackend([DEMO_REPLY]), store=store)

    async def run_before(pilot) -> None:
        await _chat(pilot)
        await pilot.press("f2", "tab", "right")  # focus top-k, raise it to 41
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_inspector(snap_compare, store):
    app = make_app(FakeBackend([DEMO_REPLY]), store=store)

    async def run_before(pilot) -> None:
        await _chat(pilot)
        await pilot.press("f3", "p")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


# ---- the screens and actions of the second round: picker, search, branches, attachments, thinking ----------

LONG_AGO = 1677844800.0  # 2023-03-03: the saved chats' dates then read "3 Mar 2023" on any day


def _quiet(pilot) -> None:
    pilot.app.query_one(PromptInput).cursor_blink = False


def test_model_picker(snap_compare):
    from tests.app.test_model_switch import Named, picker_app

    app = picker_app(Named("first-model", "Hello!"), {})

    async def run_before(pilot) -> None:
        await ready(pilot)
        _quiet(pilot)
        await pilot.press("f10")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_search_finds_words_in_messages(snap_compare, store):
    from tests.app.test_search import fill

    fill(store)
    store._conn.execute("UPDATE conversations SET created = ?, updated = ?", (LONG_AGO, LONG_AGO))
    app = make_app(FakeBackend(), store=store)

    async def run_before(pilot) -> None:
        await ready(pilot)
        _quiet(pilot)
        await pilot.press("ctrl+l")
        pilot.app.screen.query_one("#conv-filter").focus()
        await pilot.press(*"water bath")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_branches_show_which_version_is_on_screen(snap_compare, store):
    app = make_app(FakeBackend(["The first answer.", "A second answer."]), store=store)

    async def run_before(pilot) -> None:
        from tests.app.fake_backend import finished

        await ready(pilot)
        _quiet(pilot)
        await send(pilot, "Tell me something.")
        await pilot.press("ctrl+r")  # a second reply: a new branch, the first one kept
        await finished(pilot)
        pilot.app.chat_log.message_widgets()[-1].focus()
        await pilot.press("left")  # back to the first version
        await pilot.pause()
        assert pilot.app.state.turns[-1].content == "The first answer."

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def _attach(name: str, seen: dict[str, str]):
    async def run_before(pilot) -> None:
        await ready(pilot)
        _quiet(pilot)
        pilot.app.prompt.set_text("What is in it?")
        await pilot.press("f9", *name, "enter")
        await pilot.pause()
        seen["box"] = pilot.app.prompt.text

    return run_before


def test_attachment_accepted(snap_compare, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("remember the milk\nand the eggs\n", encoding="utf-8")
    app, seen = make_app(FakeBackend()), {}
    assert snap_compare(app, terminal_size=SIZE, run_before=_attach("notes.txt", seen))
    assert seen["box"].startswith("`notes.txt`\n```txt\nremember the milk")


def test_attachment_refused(snap_compare, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    app, seen = make_app(FakeBackend()), {}
    assert snap_compare(app, terminal_size=SIZE, run_before=_attach("photo.png", seen))
    assert seen["box"] == "What is in it?"  # the draft stays as it was
    assert any("photo.png is a binary file" in n for n in app.notices)


THINKING_REPLY = "<think>\nThe user asks 2+2. Adding gives four.\n</think>\n\nIt is **4**."


def _think(expand: bool):
    async def run_before(pilot) -> None:
        await ready(pilot)
        _quiet(pilot)
        await send(pilot, "What is 2+2?")
        if expand:
            pilot.app.chat_log.message_widgets()[-1].focus()
            await pilot.press("t")
        await pilot.pause()

    return run_before


def test_thinking_collapsed(snap_compare):
    app = make_app(FakeBackend([THINKING_REPLY]))
    assert snap_compare(app, terminal_size=SIZE, run_before=_think(expand=False))


def test_thinking_expanded(snap_compare):
    app = make_app(FakeBackend([THINKING_REPLY]))
    assert snap_compare(app, terminal_size=SIZE, run_before=_think(expand=True))


# ---- tools ------------------------------------------------------------------------------------------------


def _saved_tool_chat(store) -> int:
    """A saved chat whose reply called two tools (one result long enough to collapse, one failure)."""
    from chatapp.chat_state import ToolRecord, ToolRound, Turn, stats_to_dict
    from tests.app.fake_backend import FakeBackend

    backend = FakeBackend(["It is 10:36 in Tokyo; Paris was not found."])
    stats = list(backend.stream_reply([]))[-1]
    result = json.dumps({"timezone": "Asia/Tokyo", "datetime": "2026-12-06T10:36:57+09:00",
                         "day_of_week": "Sunday", "is_dst": False}, indent=2)  # fmt: skip
    calls = [
        ToolRecord("c1", "get_current_time", "time", '{"timezone": "Asia/Tokyo"}', "ok", result, 412.0),
        ToolRecord("c2", "get_current_time", "time", '{"timezone": "Paris"}', "error",
                   "Error: get_current_time raised: Invalid timezone: Paris", 38.0),  # fmt: skip
    ]
    turn = Turn("assistant", stats.reply, stats=stats, rounds=[ToolRound("", calls)], gen_ms=1840.0)
    conv = store.create("What time is it in Tokyo?", "fake-7b-q4_0", "")
    store.add_message(conv, "user", "What time is it in Tokyo and in Paris?")
    store.add_message(conv, "assistant", turn.content, stats_to_dict(stats, [], None, turn.rounds, turn.gen_ms))
    return conv


def test_tool_call_blocks(snap_compare, store):
    conv = _saved_tool_chat(store)
    app = make_app(FakeBackend(), store=store)

    async def run_before(pilot) -> None:
        await ready(pilot)
        pilot.app.query_one(PromptInput).cursor_blink = False
        await pilot.app._resume((conv, None))
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_tool_approval_prompt(snap_compare, store):
    import sys

    from chatapp.mcp.config import McpSettings, ServerSpec
    from chatapp.tui.widgets.status_bar import StatusBar
    from chatapp.tui.widgets.tool_call import ApprovalPrompt
    from engine.events import ToolCall
    from tests.app.fake_backend import wait_for

    server = ServerSpec("testtools", sys.executable, (str(Path(__file__).with_name("mcp_test_server.py")),))
    backend = FakeBackend([(ToolCall("c1", "add", '{"a": 2, "b": 3}'),), "5"])
    app = make_app(backend, store=store, mcp=McpSettings((server,)))

    async def run_before(pilot) -> None:
        await ready(pilot)
        pilot.app.query_one(PromptInput).cursor_blink = False
        await wait_for(pilot, lambda: pilot.app.query_one(StatusBar).tools == "6 tools", timeout=60)
        await send(pilot, "What is 2 + 3?", wait=False)
        await wait_for(pilot, lambda: pilot.app.query(ApprovalPrompt), timeout=20)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
