"""Block fields read with an array module `xp` (NumPy, or CuPy on the GPU): the helpers of every format's `dequantize`.

Each format's `dequantize(xp, b)` takes blocks b uint8 (n, block_bytes) in the file's layout and returns their
values, float32 (n, block_size), as ggml's dequantize_row_<type> does (and gguf-py's quants.py, which they
mirror operation by operation). Half-precision fields are assembled from their two bytes, so no dequantizer needs a
contiguous view of a block.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

Array = Any  # an xp.ndarray
QK_K = 256  # values in a K-quant super-block


def u16(xp: ModuleType, b: Array) -> Array:
    """Little-endian 16-bit words: b uint8 (n, 2k) -> uint16 (n, k)."""
    lo, hi = b[:, 0::2].astype(xp.uint16), b[:, 1::2].astype(xp.uint16)
    return lo | (hi << 8)  # (n, k)


def half(xp: ModuleType, b: Array) -> Array:
    """Halves: b uint8 (n, 2k) -> float32 (n, k)."""
    return xp.ascontiguousarray(u16(xp, b)).view(xp.float16).astype(xp.float32)


def u32(xp: ModuleType, b: Array) -> Array:
    """One little-endian 32-bit word per block: b uint8 (n, 4) -> uint32 (n, 1)."""
    w = b.astype(xp.uint32)
    return (w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24))[:, None]


def i8(xp: ModuleType, b: Array) -> Array:
    """Bytes read as signed: uint8 -> int16 of the same shape."""
    return (b.astype(xp.int16) ^ 128) - 128


def nibbles(xp: ModuleType, qs: Array) -> Array:
    """qs uint8 (n, 16) -> (n, 32): the 16 low nibbles, then the 16 high ones."""
    return xp.concatenate([qs & 15, qs >> 4], axis=1)


def bits(xp: ModuleType, qh: Array, n_bits: int) -> Array:
    """qh uint32 (n, 1) -> uint8 (n, n_bits): bit j of each word."""
    return ((qh >> constant(xp, "uint32", tuple(range(n_bits)))[None, :]) & 1).astype(xp.uint8)


def shifts(xp: ModuleType, *values: int) -> Array:
    """A shift vector broadcast along the second-to-last axis: (1, 1, len(values), 1) uint8."""
    return constant(xp, "uint8", values).reshape(1, 1, len(values), 1)


@functools.cache
def constant(xp: ModuleType, dtype: str, values: tuple[int, ...]) -> Array:
    """A small constant vector, made (and, under CuPy, copied to the device) once; never written to."""
    return xp.asarray(values, dtype=dtype)
