"""Saved KV caches (engine/kv_store.py): resuming without prefill, and every way a saved file can be wrong
(truncated, tampered, another model under the same name, a writer killed mid-write) ending in a recompute."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from engine import load_model
from engine.chat import ChatSession
from engine.events import Message, TurnStats
from engine.kernels import float_products
from engine.kv_store import SUFFIX, KVStore
from engine.model import RESERVE_STEP, KVCache
from engine.sampling import SamplingSettings

from .compare import assert_cache_exactly_fresh
from .synthetic import write_tiny_model

GREEDY = SamplingSettings(temperature=0.0, max_tokens=12)
PROMPT = [40 + (i * 7) % 50 for i in range(60)]  # raw ids for the tiny model


def reply(chat: ChatSession, messages=None, prompt=None) -> tuple[list[int], TurnStats]:
    events = list(chat.stream_reply(messages) if messages is not None else chat.stream_completion(prompt))
    stats = events[-1]
    assert isinstance(stats, TurnStats)
    return [e.token_id for e in events[:-1]], stats


@pytest.fixture
def tiny_path(tmp_path) -> Path:
    return write_tiny_model(tmp_path / "tiny.gguf", "llama", seed=1).path


def tiny_chat(path: Path, store: KVStore | None, autosave: bool = False) -> ChatSession:
    return ChatSession(load_model(path, n_ctx=128), GREEDY, kv_store=store, autosave=autosave)


def test_resume_continues_without_prefill(smollm2_model, tmp_path) -> None:
    """A saved conversation resumed in a new session: the prompt it shares comes from the file, the reply is the
    one an uninterrupted session gives, and the cache is exactly fresh."""
    with float_products():
        store = KVStore(tmp_path / "kv", 1 << 30)
        messages = [Message("system", "You are terse."), Message("user", "Name three rivers in Europe.")]
        first = ChatSession(smollm2_model, GREEDY, kv_store=store)
        _, stats = reply(first, messages)
        assert first.save_cache() is not None
        follow = [*messages, Message("assistant", stats.reply), Message("user", "And one in Asia?")]
        expected, _ = reply(first, follow)

        resumed = ChatSession(smollm2_model, GREEDY, kv_store=KVStore(tmp_path / "kv", 1 << 30))
        ids, stats = reply(resumed, follow)
        assert stats.restored_tokens == stats.reused_tokens >= len(first.prompt_tokens(messages))
        assert stats.evaluated_tokens <= len(smollm2_model.tokenize("And one in Asia?")) + 12
        assert ids == expected
        assert_cache_exactly_fresh(resumed)


def test_no_store_no_restore(tiny_path, tmp_path) -> None:
    store = KVStore(tmp_path / "kv", 1 << 30)
    chat = tiny_chat(tiny_path, store)
    reply(chat, prompt=PROMPT)
    chat.save_cache()
    plain = tiny_chat(tiny_path, None)
    _, stats = reply(plain, prompt=PROMPT)
    assert stats.restored_tokens == 0 and stats.reused_tokens == 0


@pytest.mark.parametrize("damage", ["truncate-header", "truncate-payload", "drop-last-byte", "flip-payload",
                                    "flip-token", "garbage"])  # fmt: skip
def test_a_damaged_file_is_recomputed(tiny_path, tmp_path, damage: str) -> None:
    store = KVStore(tmp_path / "kv", 1 << 30)
    chat = tiny_chat(tiny_path, store)
    reply(chat, prompt=PROMPT)
    path = chat.save_cache()
    data = bytearray(path.read_bytes())
    if damage == "truncate-header":
        data = data[:20]
    elif damage == "truncate-payload":
        data = data[: len(data) // 2]
    elif damage == "drop-last-byte":
        data = data[:-1]
    elif damage == "flip-payload":
        data[-100] ^= 0x40
    elif damage == "flip-token":  # an id in the header's token list: "tokens": [40, ...
        at = data.index(b'"tokens": [') + len(b'"tokens": [')
        data[at] = ord("5") if data[at] != ord("5") else ord("6")
    else:
        data = bytearray(os.urandom(len(data)))
    path.write_bytes(bytes(data))

    with float_products():
        fresh = tiny_chat(tiny_path, KVStore(tmp_path / "kv", 1 << 30))
        ids, stats = reply(fresh, prompt=PROMPT)
        assert stats.restored_tokens == 0 and stats.evaluated_tokens == len(PROMPT)
        assert ids == reply(tiny_chat(tiny_path, None), prompt=PROMPT)[0]
        assert_cache_exactly_fresh(fresh)


def test_another_model_under_the_same_name_is_not_trusted(tmp_path) -> None:
    path = tmp_path / "model.gguf"
    write_tiny_model(path, "llama", seed=1)
    store = KVStore(tmp_path / "kv", 1 << 30)
    chat = tiny_chat(path, store)
    reply(chat, prompt=PROMPT)
    assert chat.save_cache() is not None

    write_tiny_model(path, "llama", seed=2)  # same name, same shapes, other weights
    with float_products():
        other = tiny_chat(path, KVStore(tmp_path / "kv", 1 << 30))
        ids, stats = reply(other, prompt=PROMPT)
        assert stats.restored_tokens == 0
        expected, _ = reply(tiny_chat(path, None), prompt=PROMPT)
        assert ids == expected
        assert_cache_exactly_fresh(other)


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from engine import load_model, kv_store
    from engine.chat import ChatSession
    from engine.sampling import SamplingSettings

    from engine.kernels import float_products

    exact = float_products()  # kept: the parent compares in the exact mode, so the saved cache is made in it
    exact.__enter__()
    path, folder = sys.argv[1], sys.argv[2]
    prompt = [40 + (i * 7) % 50 for i in range(60)]
    chat = ChatSession(
        load_model(path, n_ctx=128),
        SamplingSettings(temperature=0.0, max_tokens=12),
        kv_store=kv_store.KVStore(folder, 1 << 30),
    )
    list(chat.stream_completion(prompt))
    chat.save_cache()  # the first save completes
    kv_store._CHUNK = 512

    def stall(written):
        if written > 2048:
            print("mid-write", flush=True)
            time.sleep(600)

    kv_store._after_chunk = stall
    list(chat.stream_completion(prompt + [7] * 20))
    chat.save_cache()  # killed in here
    """
)


def test_kill_9_during_a_cache_write_then_resume(tiny_path, tmp_path) -> None:
    folder = tmp_path / "kv"
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tiny_path), str(folder)],
        stdout=subprocess.PIPE, cwd=root, env=os.environ | {"PYTHONPATH": str(root)}, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "mid-write"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert list(folder.glob(".*.tmp")), "the writer was stopped before its rename"
    saved = list(folder.glob(f"*{SUFFIX}"))
    assert len(saved) == 1  # the first save, whole

    with float_products():
        chat = tiny_chat(tiny_path, KVStore(folder, 1 << 30))
        ids, stats = reply(chat, prompt=[*PROMPT, 7, 7])
        assert stats.restored_tokens >= len(PROMPT)  # from the first save
        expected, _ = reply(tiny_chat(tiny_path, None), prompt=[*PROMPT, 7, 7])
        assert ids == expected
        assert_cache_exactly_fresh(chat)


def test_the_folder_keeps_its_limit_least_recently_used_first(tiny_path, tmp_path) -> None:
    store = KVStore(tmp_path / "kv", 1 << 30)
    chat = tiny_chat(tiny_path, store)
    paths = []
    for i, first in enumerate((41, 42, 43)):
        reply(chat, prompt=[first, *PROMPT])
        paths.append(chat.save_cache())
        os.utime(paths[-1], (1000.0 + i, 1000.0 + i))  # explicit ages: no clock involved
    size = paths[0].stat().st_size
    assert store.size_bytes() == sum(p.stat().st_size for p in paths)

    # Resuming the oldest marks it used; the next save over the limit removes the least recently used (42).
    resumed = tiny_chat(tiny_path, store)
    _, stats = reply(resumed, prompt=[41, *PROMPT])
    assert stats.restored_tokens > 0
    store.max_bytes = 3 * size + size // 2
    reply(chat, prompt=[44, *PROMPT])
    newest = chat.save_cache()
    assert newest.exists() and paths[0].exists()
    assert not paths[1].exists() and paths[2].exists()
    assert store.size_bytes() <= store.max_bytes


def test_a_longer_save_replaces_its_prefix(tiny_path, tmp_path) -> None:
    store = KVStore(tmp_path / "kv", 1 << 30)
    chat = tiny_chat(tiny_path, store)
    reply(chat, prompt=PROMPT)
    first = chat.save_cache()
    chat.settings = replace(GREEDY, max_tokens=4)
    reply(chat, prompt=chat.cached_tokens + [9, 9, 9])
    second = chat.save_cache()
    assert second != first and second.exists() and not first.exists()


def test_nothing_is_saved_at_size_zero(tiny_path, tmp_path) -> None:
    chat = tiny_chat(tiny_path, KVStore(tmp_path / "kv", 0))
    reply(chat, prompt=PROMPT)
    assert chat.save_cache() is None
    assert not list((tmp_path / "kv").glob(f"*{SUFFIX}"))


def test_autosave_writes_after_every_turn_and_the_app_folder_follows_the_config(tiny_path, isolated_dirs) -> None:
    from chatapp.kv_cache import kv_cache_dir, kv_store_for
    from chatapp.settings import load_settings

    assert kv_store_for(load_settings({"kv_cache_mb": 0})) is None
    store = kv_store_for(load_settings({"kv_cache_mb": 8}))
    assert store.folder == kv_cache_dir() and store.max_bytes == 8 << 20
    chat = tiny_chat(tiny_path, store, autosave=True)
    reply(chat, prompt=PROMPT)
    (saved,) = store.entries()
    assert list(saved.tokens) == chat.cached_tokens


async def test_the_saved_chats_list_shows_the_folder_size(isolated_dirs) -> None:
    from textual.app import App

    from chatapp.kv_cache import kv_cache_dir, kv_cache_summary
    from chatapp.tui.widgets.conversations import ConversationsScreen

    assert kv_cache_summary() == ""
    kv_cache_dir().mkdir(parents=True)
    (kv_cache_dir() / f"a{SUFFIX}").write_bytes(b"\0" * 3_000_000)

    class Host(App[None]):
        def on_mount(self) -> None:
            self.push_screen(ConversationsScreen([]))

    app = Host()
    async with app.run_test() as pilot:
        await pilot.pause()
        assert app.screen.query_one("#conversations").border_subtitle == "saved KV caches: 3 MB"


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_pages(cache: KVCache) -> int:
    """Pages of the cache's own arrays that are in memory, by mincore(2): exact, and blind to whatever else
    the process allocates or frees meanwhile (a whole-process RSS reading is not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    total = 0
    for a in (cache.k, cache.v):  # one array each without a ring (SmolLM2)
        lo = a.ctypes.data & ~(PAGE - 1)
        n = -(-(a.ctypes.data + a.nbytes - lo) // PAGE)
        vec = (ctypes.c_ubyte * n)()
        assert libc.mincore(lo, n * PAGE, vec) == 0, os.strerror(ctypes.get_errno())
        total += sum(b & 1 for b in vec)
    return total


def pages_of_positions(cache: KVCache, n_pos: int) -> tuple[int, int]:
    """(fewest, most) pages that positions [0, n_pos) of every head and layer, k and v, can lie on: each head's
    run of positions is contiguous and may straddle one more page than its length needs."""
    per_head = n_pos * cache.k.shape[-1] * cache.k.itemsize
    heads = 2 * cache.k.shape[0] * cache.k.shape[1]
    return heads * -(-per_head // PAGE), heads * (-(-per_head // PAGE) + 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are counted with Linux's mincore")
def test_a_new_cache_holds_only_the_positions_it_is_given(smollm2_model) -> None:
    """The KV cache is allocated in small pages: restoring (or evaluating) the first positions commits their
    pages, not the whole cache, which NumPy's huge pages would zero and commit 2 MB at a time."""
    cache = KVCache(smollm2_model.cfg, 8192)
    assert resident_pages(cache) == 0
    cache.k[:, :, :32] = 1.0
    cache.v[:, :, :32] = 1.0
    fewest, most = pages_of_positions(cache, 32)
    assert fewest <= resident_pages(cache) <= most, f"{resident_pages(cache)} pages for 32 of 8192 positions"
    assert (cache.k[:, :, 32:] == 0).all() and (cache.k[:, :, :32] == 1).all()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are counted with Linux's mincore")
def test_a_pass_faults_in_its_positions_ahead_a_step_at_a_time(smollm2_model) -> None:
    """`reserve` makes the pages of the positions a pass will write resident beforehand (one madvise per head
    and layer, from one thread), a step of positions at a time, never past the context, and keeps the bytes
    already there."""
    cache = KVCache(smollm2_model.cfg, 600)
    cache.k[:, :, 3] = 2.0
    cache.reserve(10)
    assert cache.resident == RESERVE_STEP
    # exactly the step's pages (a page more per head where a run straddles one); nothing of the rest of the cache
    fewest, most = pages_of_positions(cache, RESERVE_STEP)
    assert fewest <= resident_pages(cache) <= most, (resident_pages(cache), fewest, most)
    cache.reserve(RESERVE_STEP)  # within the step: nothing more
    assert cache.resident == RESERVE_STEP
    cache.reserve(RESERVE_STEP + 1)
    assert cache.resident == 2 * RESERVE_STEP
    cache.reserve(2 * RESERVE_STEP + 1)
    assert cache.resident == cache.n_ctx  # the last step ends at the context
    assert (cache.k[:, :, 3] == 2).all() and not cache.k[:, :, 4:].any() and not cache.v.any()
