"""Weights in their file encoding dequantized with an array module `xp`: CuPy arrays on the GPU, NumPy in the tests.

Each type's dequantizer is its module's `dequantize(xp, b)` (engine/formats/<type>.py): blocks b uint8 (n, block_bytes)
in the file's layout -> their values, float32 (n, block_size), as ggml's dequantize_row_<type> does;
`gguf.quants.dequantize` is the oracle in the tests. DEQUANTIZERS is read off the format registry.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from gguf import GGMLQuantizationType as T

from ..formats import FORMATS

Array = Any  # an xp.ndarray

DEQUANTIZERS: dict[T, Callable[[ModuleType, Array], Array]] = {t: f.dequantize for t, f in FORMATS.items()}


def dequantize_rows(xp: ModuleType, ggml_type: T, raw: Array, cols: int) -> Array:
    """Rows of a weight in the file's encoding, raw uint8 (r, row_bytes) -> float32 (r, cols)."""
    fmt = FORMATS[ggml_type]
    r = raw.shape[0]
    blocks = raw.reshape(r * (cols // fmt.block), fmt.block_bytes)  # (r·nb, block_bytes)
    return fmt.dequantize(xp, blocks).reshape(r, cols)
