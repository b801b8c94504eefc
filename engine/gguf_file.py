"""Open a GGUF file: its metadata as plain Python values and its tensors as memory-mapped views.

A model file is untrusted input. Anything wrong with it becomes a `ModelFileError` naming the file and the
problem; nothing is copied out of the mapping here, so opening costs no more memory than the header.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from . import header_cache
from .errors import ModelFileError


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length (ne0)
    data: np.ndarray  # a view into the file mapping


# The vocabulary arrays: read once to build the tokenizer, which keeps what it needs.
VOCABULARY_KEYS = tuple(f"tokenizer.ggml.{key}" for key in ("tokens", "token_type", "scores", "merges"))


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorEntry]

    def drop_vocabulary(self) -> None:
        """Forget the vocabulary arrays (~8 MB of Python strings for a 49k vocabulary) once the tokenizer is built."""
        for key in VOCABULARY_KEYS:
            self.metadata.pop(key, None)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path.name}: metadata has no general.architecture")
        return arch


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


class _PlainReader(GGUFReader):
    """GGUFReader reading through a plain ndarray over the same mapping. gguf-py maps the file as np.memmap,
    whose Python-level __getitem__ and __array_finalize__ run for each of the millions of small slices a
    parse takes (every vocabulary string is a few): Gemma 3's 262,144-token header took 9.0 s, 3.7 s so,
    on a first open (later opens read the header cache). The view keeps the mapping alive as its base."""

    @property  # type: ignore[override]  # the base class's plain attribute, read through a property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:  # the base class assigns its np.memmap here
        self._plain = value.view(np.ndarray)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse the header of `path`; raise ModelFileError for anything that is not a readable GGUF file."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read ({e.strerror})") from None
    if size == 0:
        raise ModelFileError(f"{path}: empty file")
    if size < 24:
        raise ModelFileError(f"{path}: truncated ({size} bytes), too short for a GGUF header")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (magic {magic!r})")
    cached = header_cache.load(path)
    if cached is not None:
        metadata, entries = cached
        return GGUFFile(path, metadata, {name: TensorEntry(name, t, shape, data) for name, t, shape, data in entries})
    try:
        reader = _PlainReader(path, "r")
        metadata = {name: _field_value(field) for name, field in reader.fields.items()}
        tensors = {}
        for t in reader.tensors:
            shape = tuple(int(n) for n in t.shape)
            if t.name in tensors:
                raise ModelFileError(f"{path}: tensor {t.name} appears twice")
            tensors[t.name] = TensorEntry(t.name, GGMLQuantizationType(t.tensor_type), shape, t.data)
    except ModelFileError:
        raise
    except MemoryError:
        raise ModelFileError(f"{path}: header declares sizes too large to be real") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError) as e:
        raise ModelFileError(f"{path}: malformed GGUF ({type(e).__name__}: {e})") from None
    table = [
        (t.name, int(t.tensor_type), [int(n) for n in t.shape], int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]
    header_cache.store(path, int(reader.data_offset), metadata, table)
    return GGUFFile(path, metadata, tensors)
