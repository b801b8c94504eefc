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
