"""The kernel layer: the only place the forward pass touches quantized weights.

It is deliberately narrow -- `matvec`, `matmul`, `embedding_rows` over a `WeightMatrix` -- so that another
backend (CuPy) can provide the same four functions and run the same forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from . import cpu
from .blocks import F16_TABLE

QUANTIZED = {
    T.Q4_0: cpu.Q4_0,
    T.Q4_1: cpu.Q4_1,
    T.Q5_0: cpu.Q5_0,
    T.Q5_1: cpu.Q5_1,
    T.Q8_0: cpu.Q8_0,
    T.Q2_K: cpu.Q2_K,
    T.Q3_K: cpu.Q3_K,
    T.Q4_K: cpu.Q4_K,
    T.Q5_K: cpu.Q5_K,
    T.Q6_K: cpu.Q6_K,
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED_TYPES = frozenset(QUANTIZED) | frozenset(FLOAT_TYPES)

# Prefill dequantizes this many float32 values of W at a time before handing the tile to BLAS.
_TILE_VALUES = 1 << 21  # 8 MB


@dataclass(frozen=True)
class WeightMatrix:
    """A weight W (rows, cols) kept in its file encoding.

    `data` is uint8 (rows, row_bytes) for block formats, float32 (rows, cols) for F32 and
    uint16 (rows, cols) for F16/BF16 bit patterns.
    """

    name: str
    ggml_type: T
    rows: int  # output features
    cols: int  # input features
    data: np.ndarray

    @classmethod
    def from_raw(cls, name: str, ggml_type: T, rows: int, cols: int, raw: np.ndarray) -> WeightMatrix:
        """Wrap the tensor bytes as the file stores them (any dtype view of the same buffer)."""
        if ggml_type == T.F32:
            data = raw.view(np.float32).reshape(rows, cols)
        elif ggml_type in (T.F16, T.BF16):
            data = raw.view(np.uint16).reshape(rows, cols)
        else:
            data = raw.view(np.uint8).reshape(rows, -1)
        return cls(name, ggml_type, rows, cols, data)


def _float_rows(w: WeightMatrix, r0: int, r1: int) -> np.ndarray:
    """W[r0:r1] as float32 for the float formats."""
    part = w.data[r0:r1]
    if w.ggml_type == T.F32:
        return part
    if w.ggml_type == T.F16:
        return part.view(np.float16).astype(np.float32)
    return (part.astype(np.uint32) << 16).view(np.float32)  # BF16: the top half of a float32


def matvec(w: WeightMatrix, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """W (rows, cols) @ x (cols,) -> (rows,) float32."""
    if out is None:
        out = np.empty(w.rows, dtype=np.float32)
    code = QUANTIZED.get(w.ggml_type)
    if code is not None:
        cpu.matvec(w.data, code, F16_TABLE, np.ascontiguousarray(x, dtype=np.float32), out)
    elif w.ggml_type == T.F32:
        np.matmul(w.data, x, out=out)
    else:
        step = max(1, _TILE_VALUES // w.cols)
        for r0 in range(0, w.rows, step):
            r1 = min(w.rows, r0 + step)
            np.matmul(_float_rows(w, r0, r1), x, out=out[r0:r1])
    return out


def matmul(w: WeightMatrix, xs: np.ndarray) -> np.ndarray:
    """xs (t, cols) @ W.T -> (t, rows) float32: W dequantized a tile at a time, products by BLAS."""
    t = xs.shape[0]
    if t == 1:
        return matvec(w, xs[0])[None, :]
    out = np.empty((t, w.rows), dtype=np.float32)
    if w.ggml_type == T.F32:
        return np.matmul(xs, w.data.T, out=out)
    step = max(1, min(w.rows, _TILE_VALUES // w.cols))
    code = QUANTIZED.get(w.ggml_type)
    tile = np.empty((step, w.cols), dtype=np.float32) if code is not None else None
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        if code is not None:
            cpu.dequantize_rows(w.data, code, F16_TABLE, r0, tile[: r1 - r0])
            rows = tile[: r1 - r0]
        else:
            rows = _float_rows(w, r0, r1)
        np.matmul(xs, rows.T, out=out[:, r0:r1])
    return out


def embedding_rows(w: WeightMatrix, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W, decoded: (len(ids), cols) float32. Only those rows are ever expanded."""
    out = np.empty((len(ids), w.cols), dtype=np.float32)
    code = QUANTIZED.get(w.ggml_type)
    for i, r in enumerate(ids):
        if code is not None:
            cpu.dequantize_row(w.data, code, F16_TABLE, int(r), out[i])
        else:
            out[i] = _float_rows(w, int(r), int(r) + 1)[0]
    return out


def dequantize(w: WeightMatrix) -> np.ndarray:
    """The whole of W as float32 (rows, cols). For tests and small tensors only."""
    code = QUANTIZED.get(w.ggml_type)
    if code is None:
        return np.array(_float_rows(w, 0, w.rows), dtype=np.float32)
    out = np.empty((w.rows, w.cols), dtype=np.float32)
    cpu.dequantize_rows(w.data, code, F16_TABLE, 0, out)
    return out
