"""Q5_K: super-blocks of 256 values, 176 bytes: d dmin (halves) | scales[12] | qh[32] | qs[128].

Q4_K (q4_k.py) with a fifth bit: bit 2i (2i + 1) of qh[l] for value l of sub-block 2i (2i + 1). Its emitters
are Q4_K's, with the fifth bit.

Packed: q = qs[128], scale[8], min[8], qh[32]; s = d, dmin.
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
from .fields import INLINE, ROWS, half
from .q4_k import emit_k_quant_pairs, emit_quads, group_k_quant, k4_scale_min, repack, scale_min_k4, unpack
from .spec import Format, Packing

TYPE = T.Q5_K


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 256] float32."""
    # d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
    d = half(row, o, f16)
    dmin = half(row, o + 2, f16)
    for j in range(4):
        sc1, m1 = k4_scale_min(row, o, 2 * j)
        sc2, m2 = k4_scale_min(row, o, 2 * j + 1)
        d1 = d * sc1
        d2 = d * sc2
        mm1 = dmin * m1
        mm2 = dmin * m2
        for ll in range(32):
            q = np.int32(row[o + 48 + j * 32 + ll])
            h = np.int32(row[o + 16 + ll])
            out[p + j * 64 + ll] = d1 * ((q & 15) + (((h >> (2 * j)) & 1) << 4)) - mm1
            out[p + j * 64 + 32 + ll] = d2 * ((q >> 4) + (((h >> (2 * j + 1)) & 1) << 4)) - mm2


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 256]), without materialising the block."""
    d = half(row, o, f16)
    dmin = half(row, o + 2, f16)
    total = np.float32(0.0)
    for j in range(4):
        sc1, m1 = k4_scale_min(row, o, 2 * j)
        sc2, m2 = k4_scale_min(row, o, 2 * j + 1)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        x1 = np.float32(0.0)
        x2 = np.float32(0.0)
        b = p + j * 64
        for ll in range(32):
            q = np.int32(row[o + 48 + j * 32 + ll])
            h = np.int32(row[o + 16 + ll])
            a = x[b + ll]
            c = x[b + 32 + ll]
            s1 += ((q & 15) + (((h >> (2 * j)) & 1) << 4)) * a
            s2 += ((q >> 4) + (((h >> (2 * j + 1)) & 1) << 4)) * c
            x1 += a
            x2 += c
        total += d * (sc1 * s1 + sc2 * s2) - dmin * (m1 * x1 + m2 * x2)
    return total


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


PACKING = Packing(176, ((48, 0, 128), (16, 144, 32)), (0, 2), repack, unpack)  # repack, unpack: Q4_K's scales


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    t0 = np.empty(ROWS, dtype=np.int32)
    t1 = np.empty(ROWS, dtype=np.int32)
    f0 = np.empty(ROWS, dtype=np.float32)
    f1 = np.empty(ROWS, dtype=np.float32)
    group_k_quant(q, s, g, xq, dx, xsum, acc, t0, t1, f0, f1, True)


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][dmin f16][scales 12][qh 32][qs 128]: as Q4_K with a fifth bit from qh
    n = b.shape[0]
    d, dmin = arrays.half(xp, b[:, 0:2]), arrays.half(xp, b[:, 2:4])  # (n, 1) each
    sc, mn = scale_min_k4(xp, b[:, 4:16])
    dl = (d * sc.astype(xp.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(xp.float32)).reshape(n, 8, 1)
    ql = ((b[:, 48:176].reshape(n, 4, 1, 32) >> arrays.shifts(xp, 0, 4)) & 15).reshape(n, 8, 32)
    qh = ((b[:, 16:48].reshape(n, 1, 1, 32) >> arrays.shifts(xp, *range(8))) & 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).astype(xp.float32)
    return (dl * q - ml).reshape(n, arrays.QK_K)


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    dot=dot,
    packing=PACKING,
    group=group,
    emitters={PAIRS: partial(emit_k_quant_pairs, fifth_bit=True), QUADS: partial(emit_quads, fifth_bit=True)},
    quad_byte_max=31,
    prefetch=True,
)
