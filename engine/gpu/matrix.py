"""Weights on the device in their file encoding, and the one product over them.

A `DeviceMatrix` holds W's raw GGUF bytes, uint8 (rows, row_bytes), uploaded once: a Q4 weight costs Q4 memory
on the device. `matmul` dequantizes W a tile of rows at a time (dequantize.py) and multiplies each tile with
xp.matmul (cuBLAS under CuPy), so the float32 copy never exceeds one tile.

`DeviceExperts` is a mixture-of-experts layer's 3-D tensor the same way, raw uint8 (n_expert, rows, row_bytes):
`expert(e)` is expert e's DeviceMatrix, a view of its slice, so a product dequantizes that expert's rows only.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from ..kernels import WeightMatrix, pages
from ..moe import ExpertTensor
from .dequantize import DEQUANTIZERS, dequantize_rows

# Float32 values of W dequantized at a time (16 MB; the dequantizers' temporaries take a few times that).
TILE_VALUES = 1 << 22


@dataclass(frozen=True)
class DeviceMatrix:
    """W (rows, cols) on the device as the file stores it: raw uint8 (rows, row_bytes)."""

    name: str
    ggml_type: T
    rows: int  # output features
    cols: int  # input features
    raw: Any  # xp uint8 (rows, row_bytes)

    @classmethod
    def upload(cls, xp: ModuleType, w: WeightMatrix) -> DeviceMatrix:
        """Copy W's file bytes to the device (under NumPy: a view, no copy).

        Once copied, the file pages under W are given back: the CPU never reads them again (the embedding
        lookup of a tied output faults back in only the rows it reads).
        """
        if w.ggml_type not in DEQUANTIZERS:
            raise ValueError(f"tensor {w.name}: type {w.ggml_type.name} has no device dequantizer")
        host = np.ascontiguousarray(w.data).view(np.uint8).reshape(w.rows, -1)  # (rows, row_bytes)
        raw = xp.asarray(host)
        if xp is not np:
            pages.release(host)
        return cls(w.name, w.ggml_type, w.rows, w.cols, raw)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self, xp: ModuleType, r0: int = 0, r1: int | None = None) -> Any:
        """W[r0:r1] as float32 (r1 - r0, cols). The whole of W only for tests and small tensors."""
        return dequantize_rows(xp, self.ggml_type, self.raw[r0:r1], self.cols)


@dataclass(frozen=True)
class DeviceExperts:
    """n_expert matrices (rows, cols) on the device as the file stores them: raw uint8 (n_expert, rows, row_bytes)."""

    name: str
    ggml_type: T
    n_expert: int
    rows: int  # output features of one expert
    cols: int  # input features
    raw: Any  # xp uint8 (n_expert, rows, row_bytes)

    @classmethod
    def upload(cls, xp: ModuleType, t: ExpertTensor) -> DeviceExperts:
        """Copy the tensor's file bytes to the device, every expert in its encoding (under NumPy: a view)."""
        if t.ggml_type not in DEQUANTIZERS:
            raise ValueError(f"tensor {t.name}: type {t.ggml_type.name} has no device dequantizer")
        host = np.ascontiguousarray(t.data).view(np.uint8).reshape(t.n_expert, t.rows, -1)  # (n, rows, row_bytes)
        raw = xp.asarray(host)
        if xp is not np:
            pages.release(host)
        return cls(t.name, t.ggml_type, t.n_expert, t.rows, t.cols, raw)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def expert(self, e: int) -> DeviceMatrix:
        """Expert e as a matrix (rows, cols): a view of its slice of the device bytes, no copy."""
        if not 0 <= e < self.n_expert:
            raise IndexError(f"{self.name}: expert {e} of {self.n_expert}")
        return DeviceMatrix(f"{self.name}[{e}]", self.ggml_type, self.rows, self.cols, self.raw[e])


def matmul(xp: ModuleType, w: DeviceMatrix, x: Any) -> Any:
    """x (t, cols) @ W.T -> (t, rows) float32, W dequantized TILE_VALUES at a time."""
    t = x.shape[0]
    if x.shape[1] != w.cols:
        raise ValueError(f"{w.name}: {w.cols} columns, x has {x.shape[1]}")
    out = xp.empty((t, w.rows), dtype=xp.float32)
    step = max(1, min(w.rows, TILE_VALUES // w.cols))
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        out[:, r0:r1] = xp.matmul(x, w.dequantize(xp, r0, r1).T)  # (t, r1 - r0)
    return out
