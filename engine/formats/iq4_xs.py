"""IQ4_XS: super-blocks of 256 values, 136 bytes: d (half) | scales_h (u16) | scales_l[4] | qs[128].

Sub-block i (32 values) has the 6-bit scale ls = low nibble i of scales_l | bits 2i, 2i+1 of scales_h << 4, and
its values are (d · (ls - 32)) · kvalues[nibble], IQ4_NL's codebook over qs[16i : 16i + 16] (low nibbles, then
high).

Packed: q = qs[128], ls[8] (the scales decoded at packing, one byte each); s = d. The kernels are IQ4_NL's per
sub-block (iq4_nl.py: the codebook looked up with a byte shuffle), each sum scaled by its ls - 32 in integers.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from . import arrays
from .arrays import Array
from .emit import F32, I16, I32, PAIRS, QUADS, Emitter, RunBiases, Token, centred_products, splat_const, vt
from .fields import INLINE, ROWS, h2f, half, qbyte, set_qbyte
from .iq4_nl import KVALUES, codebook, pair_sums, quad_sums, run_sum
from .spec import Format, Packing

TYPE = T.IQ4_XS


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def scale(row, o, i):
    """ls - 32 of sub-block i of the block at row[o:] (scales_h @2, scales_l @4)."""
    lo = (np.int32(row[o + 4 + i // 2]) >> (4 * (i % 2))) & 15
    hi = ((np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8)) >> (2 * i)) & 3
    return (lo | (hi << 4)) - 32


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 256] float32."""
    d = half(row, o, f16)
    for i in range(8):
        dl = d * np.float32(scale(row, o, i))
        for j in range(16):
            q = np.int32(row[o + 8 + 16 * i + j])
            out[p + 32 * i + j] = dl * np.float32(KVALUES[q & 15])
            out[p + 32 * i + j + 16] = dl * np.float32(KVALUES[q >> 4])


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 256]), without materialising the block."""
    d = half(row, o, f16)
    total = np.float32(0.0)
    for i in range(8):
        s = np.float32(0.0)
        for j in range(16):
            q = np.int32(row[o + 8 + 16 * i + j])
            b = p + 32 * i + j
            s += np.float32(KVALUES[q & 15]) * x[b] + np.float32(KVALUES[q >> 4]) * x[b + 16]
        total += d * np.float32(scale(row, o, i)) * s
    return total


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


@njit(inline="always", cache=True, nogil=True)
def repack(row, o, q, s, g, b, r):
    """The 6-bit scales decoded to ls[8] (0..63) at q[128:136]."""
    for i in range(8):
        set_qbyte(q, g, b, 128 + i, r, scale(row, o, i) + 32)


@njit(inline="always", cache=True, nogil=True)
def unpack(q, s, g, b, r, out, o):
    """scales_h and scales_l re-encoded from ls[8] (the inverse of `scale`)."""
    h = 0
    for i in range(8):
        ls = np.int32(qbyte(q, g, b, 128 + i, r))
        h |= (ls >> 4) << (2 * i)
        if i % 2 == 0:
            out[o + 4 + i // 2] = ls & 15
        else:
            out[o + 4 + i // 2] |= (ls & 15) << 4
    out[o + 2] = h & 255
    out[o + 3] = h >> 8


PACKING = Packing(136, ((8, 0, 128),), (0,), repack, unpack)


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    fd = np.empty(ROWS, dtype=np.float32)
    for b in range(q.shape[1]):
        fd[:] = 0
        for i in range(8):
            run_sum(q, g, b, 16 * i, xq, 8 * b + i, isum, KVALUES)
            da = dx[8 * b + i]
            for r in range(ROWS):
                ls = np.int32(qbyte(q, g, b, 128 + i, r)) - 32
                fd[r] += da * np.float32(np.int32(isum[r] * ls))
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * fd[r]


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


def _scale(e: Emitter, q, qo, c, i: int):
    """ls - 32 of sub-block i for the L rows of chunk c: <L x i32> (q byte 128 + i)."""
    b = e.b
    if e.W == QUADS:
        ls = e.byte_of(e.qquad32(q, qo, c, 32 + i // 4), i % 4, False)
    else:
        w = e.qpair16(q, qo, c, 64 + i // 2)
        if i % 2:
            w = b.lshr(w, splat_const(I16, e.L, 8))
        ls = b.zext(b.and_(w, splat_const(I16, e.L, 255)), vt(I32, e.L))
    return b.sub(ls, splat_const(I32, e.L, 32))


def _emit(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
    b = e.b
    biases = RunBiases(e, toks, xsum, 8, 128, run=32)  # values stored + 128
    with e.chunks() as c:
        e.reload_barrier()  # the biases are read in the loop, not held in registers
        fd = [splat_const(F32, e.L, 0.0)] * len(toks)
        for i in range(8):
            if e.W == QUADS:
                isums = quad_sums(e, q, qo, c, 4 * i, xq, toks, 32 * i)
            else:
                isums = pair_sums(e, q, qo, c, 8 * i, xq, toks, 32 * i)
            centred = [b.sub(isums[k], biases(k, i)) for k in range(len(toks))]
            centred_products(e, fd, centred, toks, dx, i, _scale(e, q, qo, c, i))
        d = e.halves(s, e.rows(so, c))
        for k, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fmul(d, fd[k]))


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][scales_h u16][scales_l 4][qs 128]: 8 sub-blocks of 32, each d·(ls - 32)·kvalues[q]
    n = b.shape[0]
    d = arrays.half(xp, b[:, 0:2])  # (n, 1)
    h = arrays.u16(xp, b[:, 2:4]).astype(xp.int32)  # (n, 1)
    lo = (b[:, 4:8].reshape(n, 4, 1) >> arrays.constant(xp, "uint8", (0, 4))[None, None, :]) & 15  # (n, 4, 2)
    hi = (h >> arrays.constant(xp, "int32", tuple(range(0, 16, 2)))[None, :]) & 3  # (n, 8)
    ls = lo.reshape(n, 8).astype(xp.int32) | (hi << 4)
    dl = (d * (ls - 32).astype(xp.float32)).reshape(n, 8, 1)
    q = b[:, 8:136].reshape(n, 8, 16)
    q = xp.concatenate([q & 15, q >> 4], axis=2)  # (n, 8, 32)
    return (dl * codebook(xp, q)).reshape(n, arrays.QK_K)


FORMAT = Format(
    TYPE, dequantize=dequantize, deq=deq, dot=dot, packing=PACKING, group=group, emitters={PAIRS: _emit, QUADS: _emit}
)
