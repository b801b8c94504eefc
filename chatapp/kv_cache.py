"""Where the app keeps saved KV caches (engine/kv_store.py): a folder in the user cache, `kv_cache_mb` in size."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import paths

if TYPE_CHECKING:
    from engine.kv_store import KVStore

    from .settings import AppSettings


def kv_cache_dir() -> Path:
    return paths.user_cache_dir() / "kv"


def kv_store_for(settings: AppSettings) -> KVStore | None:
    """The store the settings allow, or None when `kv_cache_mb` is 0 (nothing saved, old files left as they are)."""
    if settings.kv_cache_mb <= 0:
        return None
    from engine.kv_store import KVStore

    return KVStore(kv_cache_dir(), settings.kv_cache_mb << 20)


def kv_cache_summary() -> str:
    """The line the saved-chats list shows, e.g. "saved KV caches: 41 MB"; "" when there are none."""
    folder = kv_cache_dir()
    try:
        size = sum(p.stat().st_size for p in folder.glob("*.kv"))
    except OSError:
        return ""
    return f"saved KV caches: {size / 1e6:.0f} MB" if size else ""
