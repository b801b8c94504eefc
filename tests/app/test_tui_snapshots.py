"""Snapshots of the main screen, the sampling panel and the inspector (fake backend: fixed text and timings).

Update after an intended change with `pytest tests/app/test_tui_snapshots.py --snapshot-update` and look at the
SVGs in __snapshots__/ before committing them.
"""

from __future__ import annotations

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
