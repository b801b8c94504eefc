"""A cache of parsed GGUF headers, so a second start skips gguf.GGUFReader's slow pure-Python parse.

GGUFReader turns every vocabulary string into a NumPy view one at a time: 4 s for SmolLM2's header and
over 10 s for Qwen2.5's on this machine. The parse result (metadata and the tensor table) is stored as JSON
beside a SHA-256 of the header bytes themselves, so any change to the file's header, whatever its size or
timestamps say, misses the cache. Tensor data is never cached: it is mapped from the file as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

CACHE_VERSION = 1


def cache_dir() -> Path:
    override = os.environ.get("CHATAPP_CACHE_DIR")
    if override:
        return Path(override) / "headers"
    import platformdirs

    return Path(platformdirs.user_cache_dir("chatapp")) / "headers"


def _entry_path(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    return cache_dir() / f"{key}.json"


def _header_digest(path: Path, n_bytes: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = n_bytes
        while remaining > 0:
            chunk = f.read(min(remaining, 1 << 22))
            if not chunk:
                break
            h.update(chunk)
            remaining -= len(chunk)
    return h.hexdigest()


Tensor = tuple[str, GGMLQuantizationType, tuple[int, ...], np.ndarray]  # name, type, ggml shape, data view


def load(path: Path) -> tuple[dict[str, Any], list[Tensor]] | None:
    """(metadata, [(name, type, shape, data view)]) from the cache, or None when absent or stale."""
    try:
        entry = json.loads(_entry_path(path).read_text(encoding="utf-8"))
        if entry.get("version") != CACHE_VERSION or entry["size"] != path.stat().st_size:
            return None
        if _header_digest(path, entry["data_offset"]) != entry["header_sha256"]:
            return None
        mapping = np.memmap(path, mode="r")
        tensors = []
        for name, type_id, shape, offset, n_bytes in entry["tensors"]:
            view = mapping[offset : offset + n_bytes]
            tensors.append((name, GGMLQuantizationType(type_id), tuple(shape), view))
        return entry["metadata"], tensors
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or foreign: parse the file again


def store(path: Path, data_offset: int, metadata: dict[str, Any], tensors: list[tuple]) -> None:
    """Record a parse; tensors are (name, type id, shape, offset, n_bytes). Best effort: a read-only cache
    dir just means parsing again next time."""
    try:
        entry = {
            "version": CACHE_VERSION,
            "size": path.stat().st_size,
            "data_offset": data_offset,
            "header_sha256": _header_digest(path, data_offset),
            "metadata": metadata,
            "tensors": tensors,
        }
        text = json.dumps(entry)
        target = _entry_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, TypeError, ValueError):
        pass
