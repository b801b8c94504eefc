"""The conversation store: round trips, order, export; damaged, locked and killed stores."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chatapp.chat_state import stats_line
from chatapp.export import stored_transcript
from chatapp.store import (
    BUSY_TIMEOUT_S,
    SCHEMA_VERSION,
    Conversation,
    ConversationStore,
    StoredMessage,
    StoreError,
    StoreInUseError,
    stats_to_dict,
    suggest_title,
)
from engine.events import Alternative, TokenEvent, TurnStats

REPO = Path(__file__).resolve().parents[2]


def _turn_stats(**kw) -> TurnStats:
    base = dict(
        prompt_tokens=512,
        reused_tokens=472,
        evaluated_tokens=40,
        prefill_ms=80.0,
        ttft_ms=350.0,
        decode_ms=3000.0,
        generated_tokens=121,
        stop_reason="eos",
        n_ctx_used=633,
        n_ctx=4096,
        reply="Paris.",
        warnings=("template fell back to ChatML",),
    )
    return TurnStats(**(base | kw))


def _open(path: Path) -> ConversationStore:
    store, warning = ConversationStore.open(path)
    assert warning is None
    return store


def _raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name and p.name.startswith(path.name))


# ---- the API -----------------------------------------------------------------------------------------


def test_round_trip_create_add_update_load(tmp_path):
    db = tmp_path / "sub" / "conversations.db"  # the folder is created
    tokens = [TokenEvent(7, "Paris", 40.0, 0.5, 0.9, (Alternative(7, "Paris", 0.9), Alternative(8, "Lyon", 0.05)))]
    stats = stats_to_dict(_turn_stats(), tokens)
    with _open(db) as store:
        cid = store.create("Capitals", "qwen2.5-0.5b-instruct-q8_0", "Be brief.")
        u = store.add_message(cid, "user", "Capital of France?")
        a = store.add_message(cid, "assistant", "")
        store.update_message(a, "Par")
        store.update_message(a, "Paris.", stats)
        assert store.load(cid) == Conversation(
            cid,
            "Capitals",
            "qwen2.5-0.5b-instruct-q8_0",
            "Be brief.",
            [
                StoredMessage(u, "user", "Capital of France?", None),
                StoredMessage(a, "assistant", "Paris.", stats),
            ],
        )
    with _open(db) as store:  # persisted, and stats survive JSON exactly as stats_to_dict made them
        conv = store.load(cid)
    assert [m.content for m in conv.messages] == ["Capital of France?", "Paris."]
    got = conv.messages[1].stats
    assert got == stats == json.loads(json.dumps(stats))
    assert got["generated_tokens"] == 121 and got["stop_reason"] == "eos"
    assert got["decode_tok_s"] == pytest.approx(120 / 3.0)
    assert got["warnings"] == ["template fell back to ChatML"]
    assert got["tokens"][0]["top"][1] == {"token_id": 8, "text": "Lyon", "prob": 0.05}


def test_update_message_can_clear_stats_and_set_system_prompt(tmp_path):
    with _open(tmp_path / "c.db") as store:
        cid = store.create("t", "m")
        a = store.add_message(cid, "assistant", "x", {"generated_tokens": 1})
        store.update_message(a, "y")
        store.set_system_prompt(cid, "You are terse.")
        conv = store.load(cid)
    assert conv.messages[0] == StoredMessage(a, "assistant", "y", None)
    assert conv.system_prompt == "You are terse."


def test_list_most_recently_updated_first(tmp_path):
    with _open(tmp_path / "c.db") as store:
        first, second, third = (store.create(t, "m") for t in ("first", "second", "third"))
        assert [c.id for c in store.list()] == [third, second, first]
        time.sleep(0.01)
        m = store.add_message(first, "user", "hello")
        store.add_message(first, "assistant", "hi")
        assert [c.title for c in store.list()] == ["first", "third", "second"]
        time.sleep(0.01)
        store.set_title(second, "renamed")  # a rename does not reorder
        assert [c.id for c in store.list()] == [first, third, second]
        time.sleep(0.01)
        store.update_message(m, "hello again")  # streaming updates do
        store.set_system_prompt(third, "x")
        summaries = store.list()
        assert [c.id for c in summaries] == [third, first, second]
        assert {c.id: c.n_messages for c in summaries} == {first: 2, second: 0, third: 0}
        assert summaries[2].title == "renamed" and summaries[2].model == "m"
        assert all(c.created <= c.updated for c in summaries)
        assert [c.id for c in store.list(limit=2)] == [third, first]


def test_truncate_after_for_regenerate_and_edit(tmp_path):
    with _open(tmp_path / "c.db") as store:
        cid, other = store.create("a", "m"), store.create("b", "m")
        ids = [store.add_message(cid, role, f"m{i}") for i, role in enumerate(["user", "assistant"] * 2)]
        keep = store.add_message(other, "user", "untouched")

        store.truncate_after(cid, ids[2])  # regenerate the last reply
        assert [m.id for m in store.load(cid).messages] == ids[:3]
        new = store.add_message(cid, "assistant", "again")
        assert new > ids[3]  # a deleted message's id is never reused, so a stale update cannot land here
        with pytest.raises(KeyError):
            store.update_message(ids[3], "stale update from the cancelled stream")

        store.truncate_after(cid, ids[0])  # edit the second turn
        assert [m.content for m in store.load(cid).messages] == ["m0"]
        store.truncate_after(cid, None)
        assert store.load(cid).messages == []
        assert [m.id for m in store.load(other).messages] == [keep]


def test_delete_cascades_to_messages(tmp_path):
    db = tmp_path / "c.db"
    with _open(db) as store:
        cid, other = store.create("a", "m"), store.create("b", "m")
        store.add_message(cid, "user", "x")
        store.add_message(other, "user", "y")
        store.delete(cid)
        assert [c.id for c in store.list()] == [other]
        with pytest.raises(KeyError):
            store.load(cid)
    assert _raw(db).execute("SELECT conv_id, content FROM messages").fetchall() == [(other, "y")]


def test_unknown_ids_and_roles_are_rejected(tmp_path):
    with _open(tmp_path / "c.db") as store:
        cid = store.create("a", "m")
        with pytest.raises(KeyError):
            store.add_message(cid + 1, "user", "x")
        with pytest.raises(KeyError):
            store.update_message(12345, "x")
        with pytest.raises(KeyError):
            store.set_title(cid + 1, "x")
        with pytest.raises(ValueError, match="role 'tool'"):
            store.add_message(cid, "tool", "x")
        assert store.load(cid).messages == []  # nothing half-written


def test_export_markdown(tmp_path):
    with _open(tmp_path / "c.db") as store:
        cid = store.create("Capitals of\nEurope", "qwen2.5-0.5b", "Answer in one word.")
        store.add_message(cid, "user", "Capital of France?")
        a = store.add_message(cid, "assistant", "")
        store.update_message(a, "Paris.\n", stats_to_dict(_turn_stats()))
        store.add_message(cid, "user", "And Italy?")
        store.add_message(cid, "assistant", "Rome.")  # no stats (e.g. cancelled before the end): no line
        md = stored_transcript(store, cid)
    lines = md.splitlines()
    assert lines[0] == "# Capitals of Europe"
    assert "- Model: `qwen2.5-0.5b`" in lines
    sections = [ln for ln in lines if ln.startswith("## ")]
    assert sections == ["## System prompt", "## User", "## Assistant", "## User", "## Assistant"]
    body = md[md.index("## System prompt") :]
    assert body.index("Answer in one word.") < body.index("Capital of France?") < body.index("Paris.")
    stats = [ln for ln in lines if ln.startswith("*")]
    # The chat's own stats line under the reply: one formatter for the screen and the export.
    assert stats == [f"*{stats_line(_turn_stats())}*"]
    assert stats == ["*prefill 500.0 tok/s · decode 40.0 tok/s · TTFT 350 ms · 121 tokens · stop: eos*"]
    assert lines.index(stats[0]) == lines.index("Paris.") + 2
    assert md.rstrip().endswith("Rome.")


def test_export_without_system_prompt(tmp_path):
    with _open(tmp_path / "c.db") as store:
        cid = store.create("t", "m")
        store.add_message(cid, "user", "hi")
        md = stored_transcript(store, cid)
    assert "System prompt" not in md and "## User\n\nhi" in md


def test_suggest_title():
    assert suggest_title("  \n  What is   the capital\tof France?\nMore text") == "What is the capital of France?"
    assert suggest_title("# Heading as first line") == "Heading as first line"
    long = suggest_title("Explain " + "the very long question " * 10)
    assert len(long) <= 48 and long.endswith("…") and long.startswith("Explain the very long question")
    assert not long[:-1].endswith(" ")
    assert len(suggest_title("x" * 200)) == 48
    assert suggest_title("   \n ") == "New chat"


def test_sqlite_settings(tmp_path):
    db = tmp_path / "c.db"
    with _open(db) as store:
        c = store._conn
        assert c.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert c.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL
        assert c.execute("PRAGMA foreign_keys").fetchone() == (1,)
        assert c.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)


def test_store_refuses_other_threads(tmp_path):
    """UI thread only: a call from a worker thread is a bug and fails loudly."""
    with _open(tmp_path / "c.db") as store:
        errors = []
        t = threading.Thread(target=lambda: errors.append(_catch(store.list)))
        t.start()
        t.join()
        assert isinstance(errors[0], sqlite3.ProgrammingError)


def _catch(fn):
    try:
        fn()
    except Exception as e:
        return e


def test_two_instances_share_a_store(tmp_path):
    """Two running apps: neither holds the write lock between writes, so both can open and write."""
    db = tmp_path / "c.db"
    with _open(db) as one, _open(db) as two:
        a = one.create("from one", "m")
        b = two.create("from two", "m")
        one.add_message(b, "user", "cross-write")
        assert {c.title for c in two.list()} == {"from one", "from two"}
        assert two.load(b).messages[0].content == "cross-write"
        assert one.load(a).messages == []


def test_store_does_not_load_the_engine():
    """The store is plain SQLite; importing it must not pull in Numba through `engine`."""
    code = "import sys, chatapp.store; print(sorted(m for m in sys.modules if m.split('.')[0] == 'engine'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- damaged files ------------------------------------------------------------------------------------


def _assert_moved_aside(db: Path, warning: str | None, old_bytes: bytes) -> Path:
    corrupt = [  # the moved database; its -wal/-shm companions (if any) sit beside it under the same name
        p
        for p in db.parent.iterdir()
        if p.name.startswith(db.name + ".corrupt-") and not p.name.endswith(("-wal", "-shm"))
    ]
    assert len(corrupt) == 1, _siblings(db)
    aside = corrupt[0]
    assert aside.read_bytes() == old_bytes  # kept, byte for byte
    assert warning is not None and str(db) in warning and str(aside) in warning and "\n" not in warning
    return aside


def _assert_new_store_works(store: ConversationStore, db: Path) -> None:
    assert store.list() == []
    cid = store.create("fresh", "m")
    store.add_message(cid, "user", "hello")
    store.close()
    with _open(db) as again:  # and it is a sound store from now on
        assert again.load(cid).messages[0].content == "hello"


def test_garbage_file_is_moved_aside(tmp_path):
    db = tmp_path / "conversations.db"
    garbage = random.Random(0).randbytes(10_000)
    db.write_bytes(garbage)
    store, warning = ConversationStore.open(db)
    _assert_moved_aside(db, warning, garbage)
    assert "not a database" in warning
    _assert_new_store_works(store, db)


def test_damaged_file_keeps_its_wal_beside_it(tmp_path):
    """A -wal left next to a damaged file moves with it (so the pair can be recovered together), and no
    stale -wal is left for the new store to replay."""
    db = tmp_path / "conversations.db"
    db.write_bytes(b"garbage" * 1000)
    wal = tmp_path / "conversations.db-wal"
    wal.write_bytes(b"old wal" * 100)
    store, warning = ConversationStore.open(db)
    aside = _assert_moved_aside(db, warning, b"garbage" * 1000)
    assert Path(f"{aside}-wal").read_bytes() == b"old wal" * 100
    _assert_new_store_works(store, db)


def test_second_damage_in_the_same_second_keeps_both_copies(tmp_path):
    db = tmp_path / "conversations.db"
    for payload in (b"first garbage" * 100, b"second garbage" * 100):
        db.unlink(missing_ok=True)
        db.write_bytes(payload)
        store, warning = ConversationStore.open(db)
        assert warning is not None
        store.close()
    kept = sorted(p.read_bytes() for p in tmp_path.iterdir() if ".corrupt-" in p.name)
    assert kept == sorted([b"first garbage" * 100, b"second garbage" * 100])


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.02])
def test_truncated_database_is_moved_aside(tmp_path, keep):
    db = tmp_path / "conversations.db"
    with _open(db) as store:
        cid = store.create("big", "m")
        for i in range(300):
            store.add_message(cid, "user", f"message {i} " + "x" * 1000)
    size = db.stat().st_size
    assert not (tmp_path / "conversations.db-wal").exists()  # closed cleanly: everything is in the main file
    cut = int(size * keep) // 4096 * 4096 + 1234  # mid-page
    truncated = db.read_bytes()[:cut]
    db.write_bytes(truncated)

    store, warning = ConversationStore.open(db)
    _assert_moved_aside(db, warning, truncated)
    _assert_new_store_works(store, db)


def test_foreign_sqlite_file_is_moved_aside(tmp_path):
    db = tmp_path / "conversations.db"
    with _raw(db) as c:
        c.execute("CREATE TABLE notes (body TEXT)")
        c.execute("INSERT INTO notes VALUES ('not ours')")
    old = db.read_bytes()
    store, warning = ConversationStore.open(db)
    _assert_moved_aside(db, warning, old)
    assert "notes" in warning
    _assert_new_store_works(store, db)


def test_store_missing_a_table_is_moved_aside(tmp_path):
    db = tmp_path / "conversations.db"
    _open(db).close()
    c = _raw(db)
    c.execute("DROP TABLE messages")
    c.close()
    store, warning = ConversationStore.open(db)
    assert warning is not None and "messages" in warning
    _assert_new_store_works(store, db)


def test_store_from_a_newer_version_is_left_alone(tmp_path):
    db = tmp_path / "conversations.db"
    _open(db).close()
    c = _raw(db)
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    c.close()
    old = db.read_bytes()
    with pytest.raises(StoreError, match="newer chatapp") as err:
        ConversationStore.open(db)
    assert str(db) in str(err.value)
    assert db.read_bytes() == old and not any(".corrupt-" in name for name in _siblings(db))


# ---- locks ---------------------------------------------------------------------------------------------


def test_locked_store_is_reported_in_use(tmp_path, monkeypatch):
    db = tmp_path / "conversations.db"
    with _open(db) as store:
        cid = store.create("mine", "m")
    other = _raw(db)
    other.execute("BEGIN EXCLUSIVE")
    # How long opening may wait is counted, not timed: each connection's busy timeout, summed over the
    # connections it opens, is the most it can wait for the lock (a wall-clock figure would flake when loaded).
    timeouts = []
    connect = sqlite3.connect

    def counting_connect(*args, **kwargs):
        timeouts.append(kwargs.get("timeout", 5.0))  # sqlite3's default wait is 5 s
        return connect(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", counting_connect)
    try:
        with pytest.raises(StoreInUseError, match="in use") as err:
            ConversationStore.open(db)
        assert timeouts and sum(timeouts) <= 2 * BUSY_TIMEOUT_S <= 2.0, timeouts
        assert str(db) in str(err.value)
        assert not any(".corrupt-" in name for name in _siblings(db))  # "in use" is never "damaged"

        store, warning = ConversationStore.open(db, fallback_new=True)
        with store:
            assert store.path != db and store.path.parent == db.parent and store.path.suffix == ".db"
            assert str(db) in warning and str(store.path) in warning
            assert store.list() == []
            store.add_message(store.create("meanwhile", "m"), "user", "x")
    finally:
        other.execute("ROLLBACK")
        other.close()
    with _open(db) as store:  # the original is intact once the lock is gone
        assert [c.id for c in store.list()] == [cid]


def test_exclusively_locked_non_wal_file_is_in_use_not_damaged(tmp_path):
    """A rollback-journal exclusive lock blocks even reads; that must read as 'in use', never as damage."""
    db = tmp_path / "conversations.db"
    other = _raw(db)
    other.execute("CREATE TABLE t (x)")
    other.execute("BEGIN EXCLUSIVE")
    other.execute("INSERT INTO t VALUES (1)")
    try:
        with pytest.raises(StoreInUseError, match="in use"):
            ConversationStore.open(db)
        alt = ConversationStore.open_alternate(db)
        alt.close()
        assert alt.path.name.startswith("conversations-") and alt.path.name.endswith(".db")
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert not any(".corrupt-" in p.name for p in tmp_path.iterdir())


# ---- kill -9 ---------------------------------------------------------------------------------------------

_WRITER = """
import sys
from pathlib import Path
from chatapp.store import ConversationStore
store, warning = ConversationStore.open(Path(sys.argv[1]))
assert warning is None, warning
msg = store.add_message(int(sys.argv[2]), "assistant", "")
print("added", msg, flush=True)
i = 0
while True:
    i += 1
    store.update_message(msg, " ".join(f"t{k}" for k in range(i)), {"generated_tokens": i})
    print(i, flush=True)
"""


def _written(i: int) -> tuple[str, dict | None]:
    """What the writer's i-th update stored (i = 0: the message as added)."""
    return " ".join(f"t{k}" for k in range(i)), ({"generated_tokens": i} if i else None)


def test_kill_9_loses_at_most_the_update_in_flight(tmp_path):
    """Even runs are killed while the writer starts (open, add_message), odd runs while it streams updates."""
    db = tmp_path / "conversations.db"
    with _open(db) as store:
        cid = store.create("streaming", "m")
    rng = random.Random()
    allowed: dict[int, set[int]] = {}  # message id -> the update numbers it may hold
    streamed_runs = 0
    for run in range(12):
        child = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(db), str(cid)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        head = ""
        if run % 2:
            ready, _, _ = select.select([child.stdout], [], [], 20)
            assert ready, f"run {run}: the writer did not start"
            head = child.stdout.readline()
            assert head.startswith("added"), head
        delay = rng.uniform(0.0, 0.3)
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        out = child.stdout.read()  # the same buffered reader as readline: nothing it read ahead is lost
        child.stdout.close()
        child.wait(timeout=10)
        assert child.returncode == -signal.SIGKILL, f"run {run}: the writer ended early ({child.returncode})"
        lines = (head + out).split("\n")[:-1]  # complete lines only
        where = f"run {run} (killed after {delay:.3f} s)"

        with _open(db) as store:  # opens with no warning: the file was never damaged
            messages = store.load(cid).messages
        with _raw(db) as c:
            assert c.execute("PRAGMA integrity_check").fetchall() == [("ok",)], where
        if not lines:  # killed while starting: the message may or may not have been added, and is empty
            new = {m.id for m in messages} - allowed.keys()
            assert len(new) <= 1, where
            allowed.update({m: {0} for m in new})
        else:
            msg = int(lines[0].split()[1])
            last = int(lines[-1]) if len(lines) > 1 else 0  # the last update known to have returned
            allowed[msg] = {last, last + 1}  # ... and the one after may have committed before the print
            streamed_runs += last > 0
        assert {m.id for m in messages} == allowed.keys(), where
        for m in messages:
            matches = [i for i in allowed[m.id] if (m.content, m.stats) == _written(i)]
            assert matches, f"{where}: message {m.id} holds ...{m.content[-40:]!r}, {m.stats}"
            allowed[m.id] = set(matches)  # what it holds now must not change in later runs
    assert streamed_runs >= 3, f"only {streamed_runs} runs reached the update loop; the test checked little"
