"""Q4_1: blocks of 32 values, 20 bytes: d m (halves) | qs[16]; value j = d * nibble j + m.

Packed: q = qs[16], s = d, m. The SIMD emitters are Q4_0's with the min term (q4_0.py).
"""

from __future__ import annotations

from functools import partial
from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from . import arrays
from .arrays import Array
from .emit import PAIRS, QUADS
from .fields import INLINE, ROWS, h2f, half, qbyte
from .q4_0 import emit_q4_pairs, emit_q4_quads
from .spec import Format, Packing

TYPE = T.Q4_1


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 32] float32."""
    d = half(row, o, f16)
    m = half(row, o + 2, f16)
    for j in range(16):
        q = np.int32(row[o + 4 + j])
        out[p + j] = d * (q & 15) + m
        out[p + j + 16] = d * (q >> 4) + m


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 32]), without materialising the block."""
    s = np.float32(0.0)
    sx = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 4 + j])
        a = x[p + j]
        b = x[p + j + 16]
        s += (q & 15) * a + (q >> 4) * b
        sx += a + b
    return half(row, o, f16) * s + half(row, o + 2, f16) * sx


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


PACKING = Packing(16, ((4, 0, 16),), (0, 2))


@njit(inline="always", cache=True, nogil=True)
def _group(q, s, g, xq, dx, xsum, acc, isum):
    for b in range(q.shape[1]):
        isum[:] = 0
        for j in range(16):
            xa = np.int32(xq[b, j])
            xb = np.int32(xq[b, j + 16])
            for r in range(ROWS):
                v = np.int32(qbyte(q, g, b, j, r))
                isum[r] += (v & 15) * xa + (v >> 4) * xb
        d = dx[b]
        sx = d * np.float32(xsum[b, 0] + xsum[b, 1])  # sum of x̂ over the block, for the min
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(isum[r])) + h2f(s[g, b, 1, r]) * sx


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    _group(q, s, g, xq, dx, xsum, acc, isum)


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][m f16][qs 16]: d · q + m
    d, m = arrays.half(xp, b[:, 0:2]), arrays.half(xp, b[:, 2:4])  # (n, 1) each
    return d * arrays.nibbles(xp, b[:, 4:20]).astype(xp.float32) + m


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    dot=dot,
    packing=PACKING,
    group=group,
    emitters={PAIRS: partial(emit_q4_pairs, with_min=True), QUADS: partial(emit_q4_quads, with_min=True)},
    quad_byte_max=15,
)
