"""Full-text search over saved chats: the store's FTS5 index, and the saved-chats screen that jumps to a hit."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from chatapp.store import SCHEMA_VERSION, SNIPPET_MARKS, ConversationStore, fts_query


@pytest.fixture
def store(tmp_path: Path):
    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    yield store
    store.close()


def fill(store: ConversationStore) -> dict[str, int]:
    ids = {}
    a = store.create("Rust lifetimes", "smollm2")
    ids["a_user"] = store.add_message(a, "user", "Explain the borrow checker in Rust.")
    ids["a_reply"] = store.add_message(a, "assistant", "The borrow checker enforces ownership rules at compile time.")
    b = store.create("Café recipes", "qwen")
    ids["b_user"] = store.add_message(b, "user", "How do I make a crème brûlée?")
    ids["b_reply"] = store.add_message(b, "assistant", "")
    store.update_message(ids["b_reply"], "Heat the cream, whisk the yolks with sugar, bake in a water bath.")
    ids["a"], ids["b"] = a, b
    return ids


def test_words_are_found_in_any_message_of_any_chat(store: ConversationStore) -> None:
    ids = fill(store)
    (hit,) = store.search("borrow checker ownership")
    assert (hit.conv_id, hit.msg_id, hit.title, hit.role) == (ids["a"], ids["a_reply"], "Rust lifetimes", "assistant")
    start, end = SNIPPET_MARKS
    assert f"{start}ownership{end}" in hit.snippet
    # every word must occur; the last is a prefix (search as you type); case and accents do not matter
    assert {h.msg_id for h in store.search("borrow")} == {ids["a_user"], ids["a_reply"]}
    assert [h.msg_id for h in store.search("CREME brul")] == [ids["b_user"]]
    assert store.search("borrow brûlée") == []


def test_a_streamed_update_is_searchable_and_the_old_text_is_not(store: ConversationStore) -> None:
    ids = fill(store)
    assert [h.msg_id for h in store.search("water bath")] == [ids["b_reply"]]
    store.update_message(ids["b_reply"], "Bake it slowly.")
    assert store.search("water bath") == []
    assert [h.msg_id for h in store.search("slowly")] == [ids["b_reply"]]


def test_deleted_and_truncated_messages_leave_the_index(store: ConversationStore) -> None:
    ids = fill(store)
    store.truncate_after(ids["a"], ids["a_user"])
    assert [h.msg_id for h in store.search("borrow")] == [ids["a_user"]]
    store.delete(ids["b"])  # the messages go by ON DELETE CASCADE
    assert store.search("cream") == [] and store.search("brûlée") == []


@pytest.mark.parametrize("text", ['"', "AND", "a OR", "NEAR(x y)", "col:word", "^start", "*", "-x", "(("])
def test_query_syntax_in_the_text_is_taken_as_words(store: ConversationStore, text: str) -> None:
    fill(store)
    store.search(text)  # no FTS5 syntax error reaches the user
    assert fts_query("   ") is None and store.search("  ") == []


def test_a_schema_1_store_is_migrated_and_its_messages_indexed(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        """CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL,
               model TEXT NOT NULL, system_prompt TEXT NOT NULL DEFAULT '', created REAL NOT NULL,
               updated REAL NOT NULL);
           CREATE INDEX conversations_by_updated ON conversations (updated);
           CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
               conv_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE, role TEXT NOT NULL,
               content TEXT NOT NULL, stats TEXT, created REAL NOT NULL);
           CREATE INDEX messages_by_conv ON messages (conv_id, id);
           INSERT INTO conversations VALUES (1, 'old chat', 'm', '', 0, 0);
           INSERT INTO messages VALUES (1, 1, 'user', 'an heirloom tomato question', NULL, 0);
           PRAGMA user_version = 1;"""
    )
    conn.close()
    store, _ = ConversationStore.open(path)
    with store:
        assert [h.msg_id for h in store.search("heirloom")] == [1]
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


async def test_the_saved_chats_screen_finds_a_message_and_jumps_to_it(store: ConversationStore) -> None:
    from textual.widgets import OptionList

    from chatapp.tui.widgets.chat_log import AssistantMessage
    from chatapp.tui.widgets.conversations import ConversationsScreen
    from tests.app.fake_backend import FakeBackend, make_app, ready, wait_for

    fill(store)
    c = store.create("Long chat", "smollm2")
    for i in range(30):  # enough messages that the found one starts off screen
        store.add_message(c, "user", f"question {i}")
        store.add_message(c, "assistant", f"answer {i}" + (" about the zeppelin hangar" if i == 3 else ""))
    app = make_app(FakeBackend(), store=store)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")
        screen = app.screen
        assert isinstance(screen, ConversationsScreen)
        screen.query_one("#conv-filter").focus()
        await pilot.press(*"zeppelin")
        options = screen.query_one(OptionList)
        assert options.option_count == 2  # no title matches; the "In messages" heading and one hit
        assert "zeppelin" in str(options.get_option_at_index(1).prompt)
        await pilot.press("enter", "enter")  # to the list, then open the highlighted hit
        await wait_for(pilot, lambda: app.state.conv_id == c, what="the found chat")
        await pilot.pause()
        focused = app.focused
        assert isinstance(focused, AssistantMessage) and "zeppelin hangar" in focused.turn.content
        log = app.chat_log
        top = focused.virtual_region.y  # within the chat log's scrolled content
        assert log.scroll_y <= top < log.scroll_y + log.size.height, "the found message is not on screen"
        assert log.scroll_y < log.max_scroll_y  # scrolled to it, not left at the chat's end
        assert app.state.turns[-1].content == "answer 29"  # the whole chat is there, not just the hit
