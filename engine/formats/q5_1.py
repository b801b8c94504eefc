"""Q5_1: blocks of 32 values, 24 bytes: d m (halves) | qh[4] | qs[16]; value j = d * (nibble j | bit j of qh << 4) + m.

Packed: q = qs[16], s = d, m, qh bits 0-15, 16-31 reordered as Q5_0's (q5_0.py, whose kernels take the min term).
"""

from __future__ import annotations

from functools import partial
from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from . import arrays
from .arrays import Array
from .emit import PAIRS
from .fields import INLINE, ROWS, half, u32
from .q5_0 import emit_q5_pairs, group_q5, repack_qh, unpack_qh
from .spec import Format, Packing

TYPE = T.Q5_1


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 32] float32."""
    d = half(row, o, f16)
    m = half(row, o + 2, f16)
    qh = u32(row, o + 4)
    for j in range(16):
        q = np.int32(row[o + 8 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        out[p + j] = d * ((q & 15) | h0) + m
        out[p + j + 16] = d * ((q >> 4) | h1) + m


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 32]), without materialising the block."""
    qh = u32(row, o + 4)
    s = np.float32(0.0)
    sx = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 8 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        a = x[p + j]
        b = x[p + j + 16]
        s += ((q & 15) | h0) * a + ((q >> 4) | h1) * b
        sx += a + b
    return half(row, o, f16) * s + half(row, o + 2, f16) * sx


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


@njit(inline="always", cache=True, nogil=True)
def repack(row, o, q, s, g, b, r):
    repack_qh(s, g, b, r, 2)


@njit(inline="always", cache=True, nogil=True)
def unpack(q, s, g, b, r, out, o):
    unpack_qh(s, g, b, r, 2, out, o + 4)


PACKING = Packing(16, ((8, 0, 16),), (0, 2, 4, 6), repack, unpack)  # s = d, m, qh bits 0-15, 16-31


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    group_q5(q, s, g, xq, dx, xsum, acc, isum, True)


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][m f16][qh u32][qs 16]: d · q + m
    d, m = arrays.half(xp, b[:, 0:2]), arrays.half(xp, b[:, 2:4])  # (n, 1) each
    q = arrays.nibbles(xp, b[:, 8:24]) | (arrays.bits(xp, arrays.u32(xp, b[:, 4:8]), 32) << 4)  # (n, 32)
    return d * q.astype(xp.float32) + m


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    dot=dot,
    packing=PACKING,
    group=group,
    emitters={PAIRS: partial(emit_q5_pairs, with_min=True)},
)
