"""Branches: editing an earlier message or regenerating a reply starts a new branch and keeps the old one;
one key moves between a message's versions; the store and the export keep the tree; the KV cache reuses the
common prefix when the branch changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatapp.export import stored_transcript
from chatapp.store import ConversationStore
from chatapp.tui.widgets.chat_log import AssistantMessage, UserMessage
from engine.chat import ChatSession, common_prefix
from engine.events import Message
from engine.sampling import SamplingSettings
from tests.app.fake_backend import FakeBackend, make_app, ready, send, wait_for


@pytest.fixture
def store(tmp_path: Path):
    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    yield store
    store.close()


def contents(store: ConversationStore, conv: int) -> list[str]:
    return [m.content for m in store.load(conv).messages]


def test_the_store_keeps_a_tree_and_shows_one_branch(store: ConversationStore) -> None:
    conv = store.create("t", "m")
    q = store.add_message(conv, "user", "Q")
    a1 = store.add_message(conv, "assistant", "A1")
    store.branch_at(conv, q)  # regenerate
    a2 = store.add_message(conv, "assistant", "A2")
    assert contents(store, conv) == ["Q", "A2"] and store.siblings(a1) == [a1, a2] == store.siblings(a2)
    store.branch_at(conv, None)  # edit the first message
    q2 = store.add_message(conv, "user", "Q2")
    store.add_message(conv, "assistant", "B")
    assert contents(store, conv) == ["Q2", "B"] and store.siblings(q2) == [q, q2]
    assert store.switch_branch(conv, q) == a2  # the most recent branch under Q
    assert contents(store, conv) == ["Q", "A2"]
    store.switch_branch(conv, a1)
    assert contents(store, conv) == ["Q", "A1"]

    text = stored_transcript(store, conv)
    assert text.index("A1") < text.index("## Branch 1, from message 2") < text.index("A2")
    assert "## Branch 2, from message 1" in text and "Q2" in text and "B" in text.split("## Branch 2")[1]


def test_a_straight_chat_of_an_older_store_is_one_branch(store: ConversationStore) -> None:
    conv = store.create("t", "m")
    for text in ("one", "two", "three"):
        store.add_message(conv, "user", text)
    assert contents(store, conv) == ["one", "two", "three"]
    store.truncate_after(conv, store.load(conv).messages[0].id)
    assert contents(store, conv) == ["one"]


async def test_regenerate_keeps_the_old_reply_and_the_arrows_move_between_them(store) -> None:
    backend = FakeBackend(["First answer.", "Second answer."])
    app = make_app(backend, store=store)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "Question?")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not app.generating and app.state.turns[-1].content == "Second answer.")
        await pilot.pause()
        reply = app.query(AssistantMessage).last()
        assert reply.border_subtitle.startswith("‹ 2/2 ›")
        reply.focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: app.state.turns[-1].content == "First answer.", what="the first version")
        assert app.query(AssistantMessage).last().border_subtitle.startswith("‹ 1/2 ›")
        app.query(AssistantMessage).last().focus()
        await pilot.press("right")
        await wait_for(pilot, lambda: app.state.turns[-1].content == "Second answer.", what="the second again")
    assert contents(store, app.state.conv_id) == ["Question?", "Second answer."]


async def test_editing_an_earlier_message_branches_and_keeps_what_followed(store) -> None:
    backend = FakeBackend()  # replies "You said: ..."
    app = make_app(backend, store=store)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await send(pilot, "alpha")
        await send(pilot, "beta")
        app.query(UserMessage).first().focus()
        await pilot.press("e")
        assert app.editing and app.prompt.text == "alpha"
        app.prompt.set_text("gamma")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.generating and len(app.state.turns) == 2, what="the edited branch")
        assert [t.content for t in app.state.turns] == ["gamma", "You said: gamma"]
        assert backend.calls[-1] == [Message("user", "gamma")]
        first = app.query(UserMessage).first()
        first.focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: app.state.turns[0].content == "alpha", what="the old branch")
        assert [t.content for t in app.state.turns] == ["alpha", "You said: alpha", "beta", "You said: beta"]


async def test_switching_branches_on_the_real_model_reuses_the_common_prefix(smollm2_model, store) -> None:
    from chatapp.tui.app import ChatApp

    chat = ChatSession(smollm2_model, SamplingSettings(temperature=0.0, max_tokens=8))
    app = ChatApp(lambda progress: chat, model_name="smollm2", settings=chat.settings, store=store)
    async with app.run_test(size=(100, 40)) as pilot:
        await wait_for(pilot, lambda: app.backend is chat, timeout=60, what="the model")
        await send(pilot, "Name a fruit.")
        await send(pilot, "Name a colour.")
        app.query(UserMessage).last().focus()
        await pilot.press("e")
        app.prompt.set_text("Name an animal.")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.generating and app.state.turns[-1].stats, timeout=120)
        app.query(UserMessage).last().focus()
        await pilot.press("left")  # back to the colour branch
        await wait_for(pilot, lambda: app.state.turns[-2].content == "Name a colour.", what="the old branch")
        cached = chat.cached_tokens  # the animal branch
        await send(pilot, "Thanks.")
    messages = [Message(t.role, t.content) for t in app.state.turns[:-1]]
    prompt = chat.prompt_tokens(messages)
    stats = app.state.turns[-1].stats
    first_turn = chat.prompt_tokens(messages[:2], add_generation_prompt=False)
    assert stats.reused_tokens == common_prefix(cached, prompt) >= len(first_turn) - 1
    assert stats.evaluated_tokens == len(prompt) - stats.reused_tokens < len(prompt) // 2 + 20
