"""BF16: one bfloat16 (the top half of a float32) per value. CPU products: engine/kernels/floats.py."""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T

from . import arrays
from .arrays import Array
from .spec import Format

TYPE = T.BF16


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # b (n, 2) -> (n, 1): a bfloat16 is the top half of a float32
    return xp.ascontiguousarray(arrays.u16(xp, b).astype(xp.uint32) << 16).view(xp.float32)


def values(w: np.ndarray) -> np.ndarray:
    """Stored bit patterns, uint16 (r, cols), as float32 (r, cols): each the top half of a float32."""
    return (w.astype(np.uint32) << 16).view(np.float32)


FORMAT = Format(TYPE, dequantize=dequantize)
