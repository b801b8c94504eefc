"""The conversation store: every conversation saved as it happens, in one SQLite file.

The UI creates a conversation, adds each message as it is sent, and updates the assistant's message while
it streams (every ~0.5 s) and once more at the end. Each write is its own short transaction, so a crash or a
`kill -9` at any moment loses at most the text generated since the last update.

Threading: the store is used from the UI thread only. The inference worker never touches it; it posts its
tokens to the UI, and the UI writes them here. The connection therefore keeps sqlite3's default
`check_same_thread=True`, so a call from any other thread fails loudly instead of racing.

Failure handling on `open`:
- a file that is not a database, fails `PRAGMA quick_check`, or holds tables that are not ours is moved aside
  to `<name>.corrupt-<timestamp>` (with its -wal/-shm files; never deleted) and a new store is started in
  its place; the returned warning names both files;
- a file whose write lock another process holds past a short busy timeout raises `StoreInUseError`; the
  caller may offer `open_alternate(path)` (or call `open(path, fallback_new=True)`), which starts a fresh
  timestamped file beside it;
- a file written by a newer chatapp (a higher schema version) raises `StoreError` and is left alone: moving
  it aside would hide the user's history from the newer app too.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # only for annotations: importing `engine` loads Numba, which the store does not need
    from engine.events import TokenEvent, TurnStats

SCHEMA_VERSION = 3  # kept in PRAGMA user_version; bump it and add a step to _MIGRATIONS
BUSY_TIMEOUT_S = 1.0  # how long a write waits for another process's write lock before "in use"
ROLES = ("system", "user", "assistant")
TITLE_CHARS = 48  # suggest_title's limit

# AUTOINCREMENT: ids are never reused, so a stale id (a message of a conversation just truncated, a
# conversation just deleted) can never reach a newer row.
_SCHEMA = (
    """CREATE TABLE conversations (
        id            INTEGER PRIMARY KEY AUTOINCREMENT,
        title         TEXT NOT NULL,
        model         TEXT NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        created       REAL NOT NULL,  -- time.time()
        updated       REAL NOT NULL   -- last change to the messages or the system prompt
    )""",
    "CREATE INDEX conversations_by_updated ON conversations (updated)",
    """CREATE TABLE messages (
        id      INTEGER PRIMARY KEY AUTOINCREMENT,  -- also the order within a conversation
        conv_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        role    TEXT NOT NULL,
        content TEXT NOT NULL,
        stats   TEXT,  -- JSON object, or NULL
        created REAL NOT NULL
    )""",
    "CREATE INDEX messages_by_conv ON messages (conv_id, id)",
)
# Schema 2: full-text search over every message, an FTS5 index of messages.content kept in step by triggers (so
# a streamed reply's every progress write is indexed in its own transaction). A new store is made at schema 1
# and brought up by the migrations, like an old one.
_SEARCH = (
    """CREATE VIRTUAL TABLE message_text USING fts5(
        content, content = 'messages', content_rowid = 'id', tokenize = 'unicode61 remove_diacritics 2'
    )""",
    """CREATE TRIGGER message_text_insert AFTER INSERT ON messages BEGIN
        INSERT INTO message_text (rowid, content) VALUES (new.id, new.content);
    END""",
    """CREATE TRIGGER message_text_delete AFTER DELETE ON messages BEGIN
        INSERT INTO message_text (message_text, rowid, content) VALUES ('delete', old.id, old.content);
    END""",
    """CREATE TRIGGER message_text_update AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO message_text (message_text, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO message_text (rowid, content) VALUES (new.id, new.content);
    END""",
)
_COLUMNS = {  # what a store of SCHEMA_VERSION must have; anything else is "not our schema"
    "conversations": {"id", "title", "model", "system_prompt", "created", "updated", "head_id"},
    "messages": {"id", "conv_id", "role", "content", "stats", "created", "parent_id"},
}
# Schema 3: a conversation is a tree. Each message has a parent (NULL: the first of its branch); editing an
# earlier message or regenerating a reply adds a sibling rather than deleting what followed. `head_id` is the
# last message of the branch on screen; the conversation is the path from the root to it. A store of schema
# 2 becomes one straight branch.
_BRANCHES = (
    "ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages (id) ON DELETE CASCADE",
    "ALTER TABLE conversations ADD COLUMN head_id INTEGER",
    """UPDATE messages SET parent_id = (
        SELECT MAX(p.id) FROM messages p WHERE p.conv_id = messages.conv_id AND p.id < messages.id)""",
    "UPDATE conversations SET head_id = (SELECT MAX(m.id) FROM messages m WHERE m.conv_id = conversations.id)",
    "CREATE INDEX messages_by_parent ON messages (parent_id)",
)
_PATH = """WITH RECURSIVE path (id) AS (
        SELECT head_id FROM conversations WHERE id = ? AND head_id IS NOT NULL
        UNION ALL SELECT m.parent_id FROM messages m JOIN path ON m.id = path.id WHERE m.parent_id IS NOT NULL
    )"""  # the ids from the head back to the root
_HEAD = object()  # add_message's default parent: the conversation's head
# _MIGRATIONS[v]: the statements that take a store from schema v to v + 1, run in the open's transaction.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (*_SEARCH, "INSERT INTO message_text (message_text) VALUES ('rebuild')"),
    2: _BRANCHES,
}

# SQLite primary result codes (sqlite3.Error.sqlite_errorcode & 0xFF).
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_CORRUPT, _SQLITE_NOTADB = 5, 6, 11, 26


@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: str  # "system" | "user" | "assistant"
    content: str
    stats: dict[str, Any] | None  # see stats_to_dict; None for user messages and unfinished replies


@dataclass(frozen=True)
class ConversationSummary:
    id: int
    title: str
    model: str
    created: float  # time.time()
    updated: float
    n_messages: int


@dataclass(frozen=True)
class SearchHit:
    conv_id: int
    msg_id: int
    title: str
    role: str
    snippet: str  # the matching words between SNIPPET_MARKS, with some context; "…" where text is left out
    updated: float  # the conversation's last change


SNIPPET_MARKS = ("\x02", "\x03")  # around each matched word in SearchHit.snippet: control characters chats lack


def fts_query(text: str) -> str | None:
    """The user's words as an FTS5 query: every word must occur (the last one as a prefix, for search as you
    type), each quoted so that FTS5's own syntax (quotes, AND, *, :, ^) is taken as text. None: no words."""
    words = [w.replace('"', '""') for w in text.split()]
    if not words:
        return None
    return " ".join(f'"{w}"' for w in words[:-1]) + (" " if len(words) > 1 else "") + f'"{words[-1]}"*'


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    model: str
    system_prompt: str
    messages: list[StoredMessage]  # the branch on screen, root first
    created: float = dataclasses.field(default=0.0, compare=False)  # time.time() when it was created


class StoreError(Exception):
    """A one-line message for the user that names the store's file."""


class StoreInUseError(StoreError):
    """Another process holds the store's write lock; the caller may offer `open_alternate`."""


class _Damaged(Exception):
    """The file is not a usable store; the message says why."""


def suggest_title(first_user_message: str) -> str:
    """A title from the first non-blank line of the user's first message, at most TITLE_CHARS long."""
    line = next((ln for ln in first_user_message.splitlines() if ln.strip()), "")
    line = " ".join(line.lstrip("#>*- ").split())
    if not line:
        return "New chat"
    if len(line) <= TITLE_CHARS:
        return line
    cut = line[: TITLE_CHARS - 1]
    if " " in cut[TITLE_CHARS // 2 :]:  # end on a word boundary when one is near the limit
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,.;:") + "…"


def stats_to_dict(stats: TurnStats, tokens: Sequence[TokenEvent] | None = None) -> dict[str, Any]:
    """The JSON-able form of a reply's stats that `add_message` / `update_message` store.

    All TurnStats fields, plus the derived `prefill_tok_s` / `decode_tok_s`, plus `tokens` (one dict per
    TokenEvent, with its top alternatives) when given. Only JSON types (lists, not tuples), so what
    `load` returns equals what was stored.
    """
    d = dataclasses.asdict(stats)
    d["warnings"] = list(stats.warnings)
    d["prefill_tok_s"] = stats.prefill_tok_s
    d["decode_tok_s"] = stats.decode_tok_s
    if tokens is not None:
        d["tokens"] = [dataclasses.asdict(t) | {"top": [dataclasses.asdict(a) for a in t.top]} for t in tokens]
    return d


class ConversationStore:
    """Conversations and their messages in one SQLite file. Use from the UI thread only."""

    def __init__(self, conn: sqlite3.Connection, path: Path):
        self._conn = conn
        self.path = path

    # ---- opening ----------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path, *, fallback_new: bool = False) -> tuple[ConversationStore, str | None]:
        """Open (or create) the store at `path`; returns (store, warning for the user or None).

        A damaged file is moved aside and a new store started (the warning says so). A store in use by
        another process raises StoreInUseError, or with `fallback_new` opens a fresh file beside it.
        """
        path = Path(path)
        try:
            return cls(_connect(path), path), None
        except StoreInUseError:
            if not fallback_new:
                raise
            store = cls.open_alternate(path)
            return store, f"{path} is in use by another program; this session is saved in {store.path}"
        except _Damaged as damaged:
            aside = _move_aside(path)
            try:
                store = cls(_connect(path), path)
            except _Damaged as again:  # cannot happen for a file we just created; say so rather than loop
                raise StoreError(f"{path}: cannot start a new store ({again})") from None
            warning = f"{path} was damaged ({damaged}); it was moved to {aside} and a new store was started"
            return store, warning

    @classmethod
    def open_alternate(cls, path: Path) -> ConversationStore:
        """A new, empty store in a timestamped file beside `path` (for when `path` is in use)."""
        path = Path(path)
        alt = _unused(path.with_name(f"{path.stem}-{_timestamp()}{path.suffix}"))
        try:
            return cls(_connect(alt), alt)
        except _Damaged as damaged:
            raise StoreError(f"{alt}: cannot start a new store ({damaged})") from None

    def close(self) -> None:
        """Close the file (a second call does nothing); any later call raises sqlite3.ProgrammingError."""
        try:
            self._conn.execute("PRAGMA optimize")
        except sqlite3.Error:
            pass  # only a hint to the query planner (or already closed); closing is what matters
        self._conn.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writes: each one is its own transaction ------------------------------------------------------

    def create(self, title: str, model: str, system_prompt: str = "") -> int:
        now = time.time()
        with self._write("create a conversation") as c:
            cur = c.execute(
                "INSERT INTO conversations (title, model, system_prompt, created, updated) VALUES (?, ?, ?, ?, ?)",
                (title, model, system_prompt, now, now),
            )
        return cast(int, cur.lastrowid)  # an INSERT always sets it

    def add_message(
        self,
        conv_id: int,
        role: str,
        content: str,
        stats: dict[str, Any] | None = None,
        parent_id: int | None | object = _HEAD,
    ) -> int:
        """Add a message after `parent_id` (default: the end of the branch on screen; None: as a first
        message); it becomes the head, so the branch on screen is the one it ends."""
        if role not in ROLES:
            raise ValueError(f"message role {role!r}: expected one of {', '.join(ROLES)}")
        stats_json = _to_json(stats)
        now = time.time()
        with self._write("save a message") as c:
            self._touch(c, conv_id, now)
            if parent_id is _HEAD:
                (parent_id,) = c.execute("SELECT head_id FROM conversations WHERE id = ?", (conv_id,)).fetchone()
            cur = c.execute(
                "INSERT INTO messages (conv_id, role, content, stats, created, parent_id) VALUES (?, ?, ?, ?, ?, ?)",
                (conv_id, role, content, stats_json, now, parent_id),
            )
            c.execute("UPDATE conversations SET head_id = ? WHERE id = ?", (cur.lastrowid, conv_id))
        return cast(int, cur.lastrowid)  # an INSERT always sets it

    def update_message(self, msg_id: int, content: str, stats: dict[str, Any] | None = None) -> None:
        """Replace a message's content and stats (stats=None clears them)."""
        stats_json = _to_json(stats)
        with self._write("update a message") as c:
            cur = c.execute("UPDATE messages SET content = ?, stats = ? WHERE id = ?", (content, stats_json, msg_id))
            if cur.rowcount == 0:
                raise KeyError(f"message {msg_id} not found")
            c.execute(
                "UPDATE conversations SET updated = ? WHERE id = (SELECT conv_id FROM messages WHERE id = ?)",
                (time.time(), msg_id),
            )

    def truncate_after(self, conv_id: int, msg_id: int | None) -> None:
        """Delete the conversation's messages after `msg_id` (all of them for None)."""
        with self._write("delete messages") as c:
            self._touch(c, conv_id, time.time())
            c.execute("DELETE FROM messages WHERE conv_id = ? AND id > ?", (conv_id, msg_id or 0))
            c.execute(
                "UPDATE conversations SET head_id = (SELECT MAX(id) FROM messages WHERE conv_id = ?) WHERE id = ?",
                (conv_id, conv_id),
            )

    def branch_at(self, conv_id: int, msg_id: int | None) -> None:
        """Make `msg_id` the head (None: before the first message), so the next message starts a branch there;
        what came after it stays, on its own branch (regenerate, edit)."""
        with self._write("start a branch") as c:
            self._touch(c, conv_id, time.time())
            c.execute("UPDATE conversations SET head_id = ? WHERE id = ?", (msg_id, conv_id))

    def switch_branch(self, conv_id: int, msg_id: int) -> int:
        """Show the branch through `msg_id`: the head becomes its most recent descendant (itself if none),
        which is returned."""
        with self._write("switch branches") as c:
            (leaf,) = c.execute(
                """WITH RECURSIVE below (id) AS (
                    SELECT id FROM messages WHERE id = ? AND conv_id = ?
                    UNION ALL SELECT m.id FROM messages m JOIN below ON m.parent_id = below.id
                ) SELECT MAX(id) FROM below""",
                (msg_id, conv_id),
            ).fetchone()
            if leaf is None:
                raise KeyError(f"message {msg_id} not found in conversation {conv_id}")
            c.execute("UPDATE conversations SET head_id = ? WHERE id = ?", (leaf, conv_id))
        return leaf

    def siblings(self, msg_id: int) -> list[int]:
        """The ids of `msg_id` and the other versions of it (same parent, same conversation), oldest first."""
        with self._read("read the branches") as c:
            rows = c.execute(
                "SELECT s.id FROM messages m JOIN messages s ON s.conv_id = m.conv_id"
                " AND s.parent_id IS m.parent_id WHERE m.id = ? ORDER BY s.id",
                (msg_id,),
            ).fetchall()
        return [r[0] for r in rows]

    def set_title(self, conv_id: int, title: str) -> None:
        """Rename; does not change `updated`, so a rename does not reorder the list."""
        with self._write("rename a conversation") as c:
            if c.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conv_id)).rowcount == 0:
                raise KeyError(f"conversation {conv_id} not found")

    def set_system_prompt(self, conv_id: int, text: str) -> None:
        with self._write("save the system prompt") as c:
            cur = c.execute(
                "UPDATE conversations SET system_prompt = ?, updated = ? WHERE id = ?",
                (text, time.time(), conv_id),
            )
            if cur.rowcount == 0:
                raise KeyError(f"conversation {conv_id} not found")

    def delete(self, conv_id: int) -> None:
        """Delete a conversation and (ON DELETE CASCADE) its messages; an unknown id is not an error."""
        with self._write("delete a conversation") as c:
            c.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))

    # ---- reads --------------------------------------------------------------------------------------

    def list(self, limit: int = 200) -> list[ConversationSummary]:
        """The most recently updated conversations first."""
        with self._read("list conversations") as c:
            rows = c.execute(
                "SELECT c.id, c.title, c.model, c.created, c.updated,"
                " (SELECT COUNT(*) FROM messages m WHERE m.conv_id = c.id)"
                " FROM conversations c ORDER BY c.updated DESC, c.id DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return [ConversationSummary(*row) for row in rows]

    def search(self, text: str, limit: int = 100) -> builtins.list[SearchHit]:  # `list` here is the method
        """Messages of every conversation that contain all of `text`'s words, best matches first."""
        query = fts_query(text)
        if query is None:
            return []
        start, end = SNIPPET_MARKS
        with self._read("search the chats") as c:
            rows = c.execute(
                "SELECT m.conv_id, m.id, c.title, m.role,"
                " snippet(message_text, 0, ?, ?, '…', 12), c.updated"
                " FROM message_text JOIN messages m ON m.id = message_text.rowid"
                " JOIN conversations c ON c.id = m.conv_id"
                " WHERE message_text MATCH ? ORDER BY rank LIMIT ?",
                (start, end, query, limit),
            ).fetchall()
        return [SearchHit(*row) for row in rows]

    def load(self, conv_id: int) -> Conversation:
        with self._read("load a conversation") as c:
            head = c.execute(
                "SELECT id, title, model, system_prompt, created FROM conversations WHERE id = ?", (conv_id,)
            ).fetchone()
            if head is None:
                raise KeyError(f"conversation {conv_id} not found")
            rows = c.execute(
                _PATH + " SELECT m.id, m.role, m.content, m.stats FROM messages m JOIN path ON m.id = path.id"
                " ORDER BY m.id",
                (conv_id,),
            ).fetchall()
        messages = [StoredMessage(i, role, content, _from_json(s)) for i, role, content, s in rows]
        conv_id, title, model, system_prompt, created = head
        return Conversation(conv_id, title, model, system_prompt, messages, created)

    def other_branches(self, conv_id: int, on_screen: set[int]) -> builtins.list[builtins.list[StoredMessage]]:
        """Root-to-leaf paths of every branch but the one on screen (`on_screen`: its ids), oldest leaf first."""
        with self._read("load a conversation") as c:
            rows = c.execute(
                "SELECT id, role, content, stats, parent_id FROM messages WHERE conv_id = ? ORDER BY id", (conv_id,)
            ).fetchall()
        by_id = {r[0]: r for r in rows}
        parents = {r[4] for r in rows}
        paths = []
        for leaf in (r[0] for r in rows if r[0] not in parents and r[0] not in on_screen):
            path, at = [], leaf
            while at is not None:
                i, role, content, stats, parent = by_id[at]
                path.append(StoredMessage(i, role, content, _from_json(stats)))
                at = parent
            paths.append(path[::-1])
        return paths

    # ---- internals ----------------------------------------------------------------------------------

    @staticmethod
    def _touch(c: sqlite3.Connection, conv_id: int, now: float) -> None:
        if c.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id)).rowcount == 0:
            raise KeyError(f"conversation {conv_id} not found")

    @contextmanager
    def _write(self, doing: str) -> Iterator[sqlite3.Connection]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        try:
            with self._conn:
                yield self._conn
        except sqlite3.ProgrammingError:
            raise  # a bug (another thread, a closed store), not a problem with the file
        except sqlite3.Error as e:
            raise _store_error(self.path, f"could not {doing}", e) from e

    @contextmanager
    def _read(self, doing: str) -> Iterator[sqlite3.Connection]:
        try:
            yield self._conn
        except sqlite3.ProgrammingError:
            raise
        except sqlite3.Error as e:
            raise _store_error(self.path, f"could not {doing}", e) from e


# ---- opening, checking and moving files aside ----------------------------------------------------------


def _connect(path: Path) -> sqlite3.Connection:
    """A checked, current-schema connection to `path`; raises _Damaged, StoreInUseError or StoreError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"{path}: cannot create its folder ({e.strerror or e})") from None
    version = _check(path)
    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)
    except sqlite3.Error as e:
        raise _store_error(path, "cannot open", e) from None
    try:
        _prepare(conn, path, version)
        return conn
    except BaseException:
        conn.close()
        raise


def _check(path: Path) -> int:
    """The schema version of the file at `path` (0: new or empty); raises _Damaged if it is not a store.

    The check runs on a read-only connection: a read-write one would, on closing, checkpoint and delete the
    -wal file beside a damaged database, and the damaged files are to be kept exactly as they were.
    """
    if not path.exists():
        return 0
    try:
        conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
    except sqlite3.Error as e:
        raise _store_error(path, "cannot open", e) from None
    try:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise _Damaged("quick_check: " + "; ".join(problems))
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {
            name
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        }
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{path} was written by a newer chatapp (schema {version}; this one reads up to"
                f" {SCHEMA_VERSION}); upgrade chatapp or move the file away"
            )
        if version == 0 and tables:
            raise _Damaged(f"not a chatapp store: it holds tables {', '.join(sorted(tables))}")
        if version == SCHEMA_VERSION:
            for table, wanted in _COLUMNS.items():
                have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
                if not wanted <= have:
                    raise _Damaged(f"table {table} lacks {', '.join(sorted(wanted - have))}")
        return version
    except sqlite3.Error as e:
        raise _classify(path, e) from None
    finally:
        conn.close()


def _prepare(conn: sqlite3.Connection, path: Path, version: int) -> None:
    """Set the connection up and bring a checked file at schema `version` to SCHEMA_VERSION."""
    try:
        # WAL: a write appends to the -wal file and a crash leaves the database consistent (the last
        # committed transaction wins). synchronous=NORMAL: in WAL mode a commit is a write() into the OS page
        # cache, which survives the *process* being killed at any moment (kill -9, a crash), so at most the
        # update in flight is lost. It skips the fsync per commit that FULL adds, which would only help on
        # power loss or an OS crash (losing the last few updates, never corrupting) and would make each
        # streaming update wait for the disk.
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")

        # Take the write lock once now, so a store that another process keeps locked is reported here
        # ("in use") rather than on the first message; create or migrate the schema under it.
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            # (not executescript: it would commit first)
            steps: tuple[str, ...] = _SCHEMA if version == 0 else ()
            steps += tuple(s for v in range(max(version, 1), SCHEMA_VERSION) for s in _MIGRATIONS[v])
            for statement in steps:
                conn.execute(statement)
            if version != SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except sqlite3.Error as e:
        raise _classify(path, e) from None


def _classify(path: Path, e: sqlite3.Error) -> Exception:
    if _code(e) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return _Damaged(str(e))
    return _store_error(path, "cannot open", e)


def _move_aside(path: Path) -> Path:
    """Rename a damaged store (and its -wal/-shm files, so they stay a pair) to <name>.corrupt-<timestamp>."""
    aside = _unused(path.with_name(f"{path.name}.corrupt-{_timestamp()}"))
    try:
        for suffix in ("", "-wal", "-shm"):  # the main file first: it is what must be kept
            src = path.with_name(path.name + suffix)
            if src.exists():
                src.rename(aside.with_name(aside.name + suffix))
    except OSError as e:
        raise StoreError(f"{path} is damaged and could not be moved aside ({e.strerror or e})") from None
    return aside


def _unused(path: Path) -> Path:
    """`path`, or `path` with -2, -3, ... appended if a file of that name already exists."""
    candidate, n = path, 1
    while any(candidate.with_name(candidate.name + s).exists() for s in ("", "-wal", "-shm")):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _code(e: sqlite3.Error) -> int:
    return (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF


def _store_error(path: Path, doing: str, e: sqlite3.Error) -> StoreError:
    if _code(e) in (_SQLITE_BUSY, _SQLITE_LOCKED):
        return StoreInUseError(f"{path} is in use by another program (it holds the write lock)")
    return StoreError(f"{path}: {doing}: {e}")


def _to_json(stats: dict[str, Any] | None) -> str | None:
    return None if stats is None else json.dumps(stats, ensure_ascii=False)


def _from_json(text: str | None) -> dict[str, Any] | None:
    return None if text is None else json.loads(text)
