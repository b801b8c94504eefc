"""Named buffers that one forward pass after another reuses for its temporaries.

A prompt's temporaries are large (SmolLM2, 256 tokens: ~12 MB a layer). Allocated fresh, each comes from a new
mmap that glibc returns on free, so every layer faults its pages in again, ~0.7 µs a page: a quarter of
SmolLM2's prefill. Taking them from a Scratch faults each page once, when the buffer is made: all of it in
one call from this thread (pages.resident_empty), since faults taken inside the parallel loops cost more (a
first 256-token SmolLM2 pass spent 12 ms more in its products than the next).
A Scratch serves one pass at a time (the model's lock holds it), and nothing taken from it may outlive the
pass: the next pass overwrites it.
"""

from __future__ import annotations

import math

import numpy as np

from .pages import resident_empty


class Scratch:
    def __init__(self) -> None:
        self._buffers: dict[tuple[str, np.dtype], np.ndarray] = {}
        self.quantized_input: np.ndarray | None = None  # the array whose int8 rows the "xq" buffers hold

    def take(self, name: str, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
        """A C-contiguous array of this shape, its contents undefined: the `name` buffer, grown when too small."""
        size, key = math.prod(shape), (name, np.dtype(dtype))
        buf = self._buffers.get(key)
        if buf is None or buf.size < size:
            buf = self._buffers[key] = resident_empty(size, dtype)
        return buf[:size].reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())
