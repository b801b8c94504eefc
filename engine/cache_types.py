"""The KV cache's storage types, by llama.cpp's names (`-ctk/--cache-type-k`, `-ctv/--cache-type-v`).

    f16   one IEEE half per value (the default): the forward pass rounds k and v to halves anyway, so exact
    q8_0  ggml's block_q8_0 per 32 values of a head: d (half) | qs[32] (int8), value j = d · qs[j], with
          d = max|x| / 127 and qs = round(x / d) (halves away from zero): 34 bytes for 32 values, 53 % of f16

A cache row (one position of one kv head) is stored as the type's bytes: float16 (head_dim,) for f16, uint8
(head_dim / 32 · 34,) -- the head's blocks back to back, exactly as ggml lays out a q8_0 row -- for q8_0. The
kernels tell the two apart by dtype (engine/kernels/attention.py `store_cache_row`, `cache_row_floats`).

The functions here are the NumPy statements of the same arithmetic, written for any array module `xp` (NumPy,
CuPy): the device offload's cache (engine/gpu/offload.py) and the prompt path without BLAS use them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import SettingsError

if TYPE_CHECKING:
    import numpy as np

CACHE_TYPES = ("f16", "q8_0")  # accepted, llama.cpp's spelling; f16 the default
Q8_BLOCK = 32  # values per q8_0 block
Q8_BYTES = 34  # bytes per q8_0 block: the half scale, then 32 int8

Array = Any  # an xp.ndarray


def check_cache_type(name: object, what: str = "cache type") -> str:
    """The type `name` as CACHE_TYPES spells it (case-insensitive); SettingsError naming the accepted ones."""
    if isinstance(name, str) and name.strip().lower() in CACHE_TYPES:
        return name.strip().lower()
    raise SettingsError(f"{what} {name!r}: expected one of {', '.join(CACHE_TYPES)}")


def row_layout(cache_type: str, head_dim: int) -> tuple[np.dtype, int]:
    """(dtype, items) of one cached row of head_dim values."""
    import numpy as np  # here, not at the top: the app's settings read CACHE_TYPES without loading NumPy

    if cache_type == "f16":
        return np.dtype(np.float16), head_dim
    if head_dim % Q8_BLOCK:
        raise SettingsError(f"cache type q8_0 needs a head size that is a multiple of 32 (this model's: {head_dim})")
    return np.dtype(np.uint8), head_dim // Q8_BLOCK * Q8_BYTES


def type_of(cache: Array) -> str:
    """The cache type of an array of cached rows (NumPy's or CuPy's), read off its dtype."""
    return "q8_0" if cache.dtype.itemsize == 1 else "f16"


def row_bytes(cache_type: str, head_dim: int) -> int:
    dtype, items = row_layout(cache_type, head_dim)
    return dtype.itemsize * items


def to_cache(xp: Any, x: Array, cache_type: str) -> Array:
    """x (..., hd) float32 -> (..., width) as the cache stores it: float16, or q8_0 blocks."""
    if cache_type == "f16":
        return x.astype(xp.float16)
    lead, hd = x.shape[:-1], x.shape[-1]
    blocks = x.astype(xp.float32).reshape(-1, Q8_BLOCK)  # (n_blocks, 32)
    d = xp.abs(blocks).max(axis=1, keepdims=True) / xp.float32(127)  # (n_blocks, 1)
    inv = xp.where(d == 0, xp.float32(0), xp.float32(1) / xp.where(d == 0, xp.float32(1), d))
    v = blocks * inv
    a = xp.abs(v)
    whole = xp.floor(a)
    qs = xp.sign(v) * (whole + xp.floor(2 * (a - whole)))  # C's roundf: halves away from zero, as ggml
    out = xp.empty((blocks.shape[0], Q8_BYTES), dtype=xp.uint8)
    out[:, :2] = d.astype(xp.float16).view(xp.uint8)
    out[:, 2:] = qs.astype(xp.int8).view(xp.uint8)
    return out.reshape(*lead, hd // Q8_BLOCK * Q8_BYTES)


def to_floats(xp: Any, rows: Array) -> Array:
    """Cached rows (..., width) -> their values (..., hd) float32."""
    if rows.dtype != xp.uint8:
        return rows.astype(xp.float32)
    lead, width = rows.shape[:-1], rows.shape[-1]
    blocks = xp.ascontiguousarray(rows).reshape(-1, Q8_BYTES)  # (n_blocks, 34)
    d = xp.ascontiguousarray(blocks[:, :2]).view(xp.float16).astype(xp.float32)  # (n_blocks, 1)
    qs = xp.ascontiguousarray(blocks[:, 2:]).view(xp.int8).astype(xp.float32)  # (n_blocks, 32)
    return (d * qs).reshape(*lead, width // Q8_BYTES * Q8_BLOCK)


def cache_bits(cache: np.ndarray) -> np.ndarray:
    """A cache as the kernels take it: float16 as its bit patterns (uint16), q8_0 blocks (uint8) as they are."""
    import numpy as np  # noqa: PLC0415 (this module stays importable without NumPy loaded)

    return cache if cache.dtype == np.uint8 else cache.view(np.uint16)
