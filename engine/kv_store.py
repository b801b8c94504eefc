"""Saved KV caches: a conversation's keys and values on disk, so resuming it skips the prefill.

A file holds one session's cache for its first n positions, and everything needed to know it is the right one:

    b"CHATKV1\\n" · header length (8 bytes, little-endian) · header (JSON) · payload · sha256 of all before it

The header names the model file's sha256, the chat template's sha256, the token ids, the cache's shape and its types
(`cache_types`: K's and V's, engine/cache_types.py; a file without them is f16's); the payload is K then V, (layers,
kv heads, n, row) each, rows as their type stores them (head_dim float16, or q8_0 blocks). A file of other cache
types than the session's is never read into it: the prompt is evaluated instead. The trailing digest covers header
and payload, so a truncated, damaged or edited file is refused, and so is any file whose model, template or ids are
not this session's: the caller then evaluates the prompt as if nothing was saved. Never a wrong cache.

Files are written to a temporary name, synced and renamed, so a crash (kill -9) mid-write leaves the previous
file or none. The folder is kept under a byte limit by removing the least recently used files (a successful
load marks a file used). A file whose ids are a prefix of a newer save of the same model and template is
redundant and removed: a conversation keeps one file, its longest.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .cache_types import type_of
from .sequences import common_prefix

if TYPE_CHECKING:
    from .model import Session

MAGIC = b"CHATKV1\n"
VERSION = 1
SUFFIX = ".kv"
DIGEST = 32
_CHUNK = 8 << 20  # bytes per write; `_after_chunk` runs after each (tests stop a writer there)
_after_chunk: Callable[[int], None] | None = None
_MODELS = "models.json"  # the model files' sha256, remembered by (size, mtime, ctime, inode)
_MAX_HEADER = 64 << 20


@dataclass(frozen=True)
class Saved:
    """A saved cache's header, as `KVStore.entries` lists it."""

    path: Path
    model_sha256: str
    template_sha256: str
    tokens: tuple[int, ...]
    size: int  # bytes on disk
    used: float  # last use (save or successful load), seconds since the epoch
    cache_types: tuple[str, str] = ("f16", "f16")  # how K and V are stored


def template_sha256(template_source: str) -> str:
    return hashlib.sha256(template_source.encode("utf-8")).hexdigest()


def _types(header: dict[str, Any]) -> tuple[str, str]:
    """A header's (K, V) cache types; a file written before there were types is f16's (its dtype says so)."""
    types = header.get("cache_types")
    if types is None:
        return ("f16", "f16") if header.get("dtype") == "float16" else ("?", "?")
    if not isinstance(types, list) or len(types) != 2 or not all(isinstance(t, str) for t in types):
        return ("?", "?")
    return types[0], types[1]


class KVStore:
    """A folder of saved caches under a size limit (bytes; 0 keeps nothing)."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()

    # -- the model file's identity -----------------------------------------------------------------------

    def model_sha256(self, path: Path) -> str:
        """The file's sha256; hashed once per version of the file (size, mtime, ctime and inode)."""
        path = Path(path).resolve()
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        known = self._read_models()
        entry = known.get(str(path))
        if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                digest.update(block)
        sha = digest.hexdigest()
        known[str(path)] = {"stamp": stamp, "sha256": sha}
        self._atomic_write(self.folder / _MODELS, [json.dumps(known).encode()])
        return sha

    def _read_models(self) -> dict[str, Any]:
        try:
            data = json.loads((self.folder / _MODELS).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    # -- save and load -------------------------------------------------------------------------------------

    def save(self, session: Session, model_sha: str, template_sha: str) -> Path | None:
        """Write the session's cache (its n_past positions); None when there is nothing to save or no room."""
        n = session.n_past
        if n == 0 or self.max_bytes <= 0 or session.cache.device is not None:  # offloaded layers stay on the GPU
            return None
        k, v = session.cache.k, session.cache.v
        # Sliding-window rings (a list of per-layer arrays) hold other positions than the first n.
        if session.cache.ring_rows is not None or not isinstance(k, np.ndarray) or not isinstance(v, np.ndarray):
            return None
        tokens = list(session.tokens)
        header = {
            "version": VERSION,
            "model_sha256": model_sha,
            "template_sha256": template_sha,
            "tokens": tokens,
            "shape": [k.shape[0], k.shape[1], n, session.model.cfg.head_dim],
            "cache_types": [session.cache.type_k, session.cache.type_v],
        }
        head = json.dumps(header).encode("utf-8")
        types = f"{session.cache.type_k}:{session.cache.type_v}"
        name = hashlib.sha256(f"{model_sha}:{template_sha}:{types}:{tokens}".encode()).hexdigest()[:32] + SUFFIX
        path = self.folder / name

        def parts():
            yield MAGIC + len(head).to_bytes(8, "little") + head
            for arr in (k, v):
                for layer in range(arr.shape[0]):
                    yield np.ascontiguousarray(arr[layer, :, :n]).tobytes()  # (kv heads, n, hd)

        self._atomic_write(path, parts(), digest=True)
        same = (model_sha, template_sha, (session.cache.type_k, session.cache.type_v))
        for other in self.entries():
            if other.path != path and (other.model_sha256, other.template_sha256, other.cache_types) == same:
                if tuple(tokens[: len(other.tokens)]) == other.tokens:  # a prefix of this save: redundant
                    other.path.unlink(missing_ok=True)
        self.evict(keep=path)
        return path if path.exists() else None

    def restore(
        self, session: Session, model_sha: str, template_sha: str, prompt: Sequence[int], at_least: int = 1
    ) -> int:
        """Load the saved cache that shares the longest prefix with `prompt`, if it holds at least `at_least`
        more of it than the session already does, into `session`; the positions restored, 0 if none."""
        cache_k, cache_v = session.cache.k, session.cache.v
        if session.cache.device is not None or session.cache.ring_rows is not None:  # see save
            return 0
        if not isinstance(cache_k, np.ndarray) or not isinstance(cache_v, np.ndarray):  # rings: see save
            return 0
        have = common_prefix(session.tokens, prompt)
        best, best_n = None, have + max(at_least, 1) - 1
        types = (session.cache.type_k, session.cache.type_v)
        for entry in self.entries():
            if (entry.model_sha256, entry.template_sha256, entry.cache_types) != (model_sha, template_sha, types):
                continue
            n = common_prefix(entry.tokens, prompt)
            if n > best_n:
                best, best_n = entry, n
        if best is None:
            return 0
        loaded = self._read(best.path, session, model_sha, template_sha)
        if loaded is None:  # damaged since it was listed: gone, and the prompt is evaluated instead
            best.path.unlink(missing_ok=True)
            return 0
        tokens, k, v = loaded
        n = min(common_prefix(tokens, prompt), best_n)
        session.truncate(0)
        cache_k[:, :, :n] = k[:, :, :n]
        cache_v[:, :, :n] = v[:, :, :n]
        session.tokens.extend(tokens[:n])
        os.utime(best.path)  # used: last to be evicted
        return n

    def _read(
        self, path: Path, session: Session, model_sha: str, template_sha: str
    ) -> tuple[list[int], np.ndarray, np.ndarray] | None:
        """The file's ids, K and V if it is whole and matches this session's model, template and shape."""
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) < len(MAGIC) + 8 + DIGEST or not data.startswith(MAGIC):
            return None
        if hashlib.sha256(memoryview(data)[:-DIGEST]).digest() != data[-DIGEST:]:
            return None
        n_head = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
        start = len(MAGIC) + 8
        try:
            header = json.loads(data[start : start + n_head])
            tokens = [int(t) for t in header["tokens"]]
            layers, n_kv, n, hd = (int(x) for x in header["shape"])
        except (ValueError, KeyError, TypeError):
            return None
        ck, cv = session.cache.k, session.cache.v
        if not isinstance(ck, np.ndarray) or not isinstance(cv, np.ndarray):  # rings: see save
            return None
        expected = (header.get("version"), header.get("model_sha256"), header.get("template_sha256"))
        if expected != (VERSION, model_sha, template_sha) or _types(header) != (type_of(ck), type_of(cv)):
            return None  # never bytes read as another type
        if (layers, n_kv, hd) != (ck.shape[0], ck.shape[1], session.model.cfg.head_dim):
            return None
        if n != len(tokens) or n > ck.shape[2]:
            return None
        offset, parts = start + n_head, []
        for cache in (ck, cv):  # K then V, (layers, n_kv, n, width) of the cache's dtype
            part = np.frombuffer(data, dtype=cache.dtype, offset=offset, count=layers * n_kv * n * cache.shape[3])
            parts.append(part.reshape(layers, n_kv, n, cache.shape[3]))
            offset += part.nbytes
        if offset + DIGEST != len(data):
            return None
        return tokens, parts[0], parts[1]

    # -- the folder ----------------------------------------------------------------------------------------

    def entries(self) -> list[Saved]:
        """Every readable saved cache's header (files that cannot be read are skipped, not trusted)."""
        out = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    if f.read(len(MAGIC)) != MAGIC:
                        continue
                    n_head = int.from_bytes(f.read(8), "little")
                    if n_head > _MAX_HEADER:
                        continue
                    header = json.loads(f.read(n_head))
                tokens = tuple(int(t) for t in header["tokens"])
                out.append(Saved(path, str(header["model_sha256"]), str(header["template_sha256"]), tokens,
                                 st.st_size, st.st_mtime, _types(header)))  # fmt: skip
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob(f"*{SUFFIX}") if p.is_file())

    def evict(self, keep: Path | None = None) -> None:
        """Remove least recently used files until the folder is under its limit (`keep` goes last)."""
        files = [p for p in self.folder.glob(f"*{SUFFIX}") if p.is_file()]
        files.sort(key=lambda p: (p == keep, p.stat().st_mtime))
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total <= self.max_bytes:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)

    def _atomic_write(self, path: Path, parts, digest: bool = False) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        h = hashlib.sha256()
        written = 0
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    for i in range(0, len(part), _CHUNK):
                        chunk = part[i : i + _CHUNK]
                        f.write(chunk)
                        h.update(chunk)
                        written += len(chunk)
                        if _after_chunk is not None:
                            _after_chunk(written)
                if digest:
                    f.write(h.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _remove_stale_temporaries(self) -> None:
        """Temporaries a crashed writer left behind (older than a minute, so a live writer's is never taken)."""
        for p in self.folder.glob(".*.tmp"):
            try:
                if time.time() - p.stat().st_mtime > 60:
                    p.unlink()
            except OSError:
                pass
