"""F32: one float32 per value, stored as is. CPU products: numpy's BLAS (engine/kernels/__init__.py)."""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T

from .arrays import Array
from .spec import Format

TYPE = T.F32


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # b (n, 4) -> (n, 1)
    return xp.ascontiguousarray(b).view(xp.float32)


def values(w: np.ndarray) -> np.ndarray:
    """Stored values (a WeightMatrix's float32 data) as float32: themselves."""
    return w


FORMAT = Format(TYPE, dequantize=dequantize)
