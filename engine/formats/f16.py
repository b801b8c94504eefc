"""F16: one IEEE half per value. CPU products: engine/kernels/floats.py, on the 16-bit patterns."""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T

from . import arrays
from .arrays import Array
from .spec import Format

TYPE = T.F16


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # b (n, 2) -> (n, 1)
    return arrays.half(xp, b)


def values(w: np.ndarray) -> np.ndarray:
    """Stored bit patterns, uint16 (r, cols), as float32 (r, cols)."""
    return w.view(np.float16).astype(np.float32)


FORMAT = Format(TYPE, dequantize=dequantize)
