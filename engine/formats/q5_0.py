"""Q5_0: blocks of 32 values, 22 bytes: d (half) | qh[4] | qs[16]; value j = d * ((nibble j | bit j of qh << 4) - 16).

Packed: q = qs[16], s = d, qh bits 0-15, 16-31, reordered (`qh_order`) so that bit jp of each byte belongs to
byte pair jp.
"""

from __future__ import annotations

from functools import partial
from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit

from . import arrays
from .arrays import Array
from .emit import F32, I16, I32, PAIRS, Emitter, Token, xsum32
from .fields import INLINE, ROWS, bits, h2f, half, qbyte, u32
from .spec import Format, Packing

TYPE = T.Q5_0


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 32] float32."""
    d = half(row, o, f16)
    qh = u32(row, o + 2)
    for j in range(16):
        q = np.int32(row[o + 6 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        out[p + j] = d * (((q & 15) | h0) - 16)
        out[p + j + 16] = d * (((q >> 4) | h1) - 16)


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 32]), without materialising the block."""
    qh = u32(row, o + 2)
    s = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 6 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        s += (((q & 15) | h0) - 16) * x[p + j] + (((q >> 4) | h1) - 16) * x[p + j + 16]
    return half(row, o, f16) * s


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


@njit(inline="always", cache=True, nogil=True)
def _even_bits(v):
    """Bits 0, 2, ..., 14 of v packed into bits 0-7."""
    v &= 0x5555
    v = (v | (v >> 1)) & 0x3333
    v = (v | (v >> 2)) & 0x0F0F
    return (v | (v >> 4)) & 0x00FF


@njit(inline="always", cache=True, nogil=True)
def _spread_bits(v):
    """Bits 0-7 of v spread to bits 0, 2, ..., 14 (the inverse of _even_bits)."""
    v &= 0x00FF
    v = (v | (v << 4)) & 0x0F0F
    v = (v | (v << 2)) & 0x3333
    return (v | (v << 1)) & 0x5555


@njit(inline="always", cache=True, nogil=True)
def qh_order(h):
    """Q5_0's and Q5_1's 16 high bits reordered for the kernels: bit 2t -> bit t, bit 2t + 1 -> bit 8 + t."""
    return np.uint16(_even_bits(h) | (_even_bits(h >> 1) << 8))


@njit(inline="always", cache=True, nogil=True)
def qh_unorder(h):
    """The inverse of qh_order."""
    return np.uint16(_spread_bits(h) | (_spread_bits(h >> 8) << 1))


@njit(inline="always", cache=True, nogil=True)
def repack_qh(s, g, b, r, field):
    """The qh fields s[field], s[field + 1] (bits 0-15, 16-31) reordered for the kernels (`qh_order`)."""
    s[g, b, field, r] = qh_order(np.int64(s[g, b, field, r]))
    s[g, b, field + 1, r] = qh_order(np.int64(s[g, b, field + 1, r]))


@njit(inline="always", cache=True, nogil=True)
def unpack_qh(s, g, b, r, field, out, o):
    """The inverse of repack_qh: the two qh fields back to the file's 4 bytes at out[o : o + 4]."""
    for h in range(2):
        v = np.int64(qh_unorder(np.int64(s[g, b, field + h, r])))
        out[o + 2 * h] = np.uint8(v & 255)
        out[o + 2 * h + 1] = np.uint8(v >> 8)


@njit(inline="always", cache=True, nogil=True)
def repack(row, o, q, s, g, b, r):
    repack_qh(s, g, b, r, 1)


@njit(inline="always", cache=True, nogil=True)
def unpack(q, s, g, b, r, out, o):
    unpack_qh(s, g, b, r, 1, out, o + 2)


PACKING = Packing(16, ((6, 0, 16),), (0, 2, 4), repack, unpack)  # s = d, qh bits 0-15, 16-31


@njit(inline="always", cache=True, nogil=True)
def group_q5(q, s, g, xq, dx, xsum, acc, isum, with_min):
    """Q5_0 (values - 16), or Q5_1 with its min (s[1]); the qh fields are the last two of s."""
    qh = 2 if with_min else 1
    for b in range(q.shape[1]):
        isum[:] = 0
        for j in range(16):
            xa = np.int32(xq[b, j])
            xb = np.int32(xq[b, j + 16])
            k = (j >> 1) + 8 * (j & 1)
            for r in range(ROWS):
                v = np.int32(qbyte(q, g, b, j, r))
                lo = (v & 15) | (bits(s[g, b, qh, r], k, 1) << 4)  # qh bit j (see qh_order)
                hi = (v >> 4) | (bits(s[g, b, qh + 1, r], k, 1) << 4)  # qh bit j + 16
                isum[r] += lo * xa + hi * xb
        d = dx[b]
        if with_min:
            sx = d * np.float32(xsum[b, 0] + xsum[b, 1])  # sum of x̂ over the block, for the min
            for r in range(ROWS):
                acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(isum[r])) + h2f(s[g, b, 1, r]) * sx
        else:
            off = np.int32(16 * (xsum[b, 0] + xsum[b, 1]))  # the -16 of every value
            for r in range(ROWS):
                acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(np.int32(isum[r] - off)))


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    group_q5(q, s, g, xq, dx, xsum, acc, isum, False)


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


# Pairs (Q5_0 and Q5_1): nibbles plus a fifth bit from two qh fields (values 0-15, 16-31; - 16 for Q5_0).
# The qh fields (s[1], s[2] for Q5_0; s[2], s[3] for Q5_1, after d and m) hold qh's bits reordered at packing:
# low byte = bits of the even values, high byte = odd ones, so bit jp of each byte belongs to byte pair jp.
# Values <= 31: pmaddubsw pairs <= 7874, 2 byte pairs (4 pmaddubsw) per 16-bit accumulator (<= 31496), then
# widened.
def emit_q5_pairs(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token], with_min: bool) -> None:
    b = e.b
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    total = [xsum32(e, xsum, t.xb) for t in toks]
    if with_min:  # the min term: m * sum(x̂)
        sx = [e.fsplat(b.fmul(e.load_scalar(dx, t.xb), b.sitofp(tot, F32))) for t, tot in zip(toks, total, strict=True)]
    else:  # every value is v - 16
        offset = [e.splat(b.mul(tot, ir.Constant(I32, 16)), e.L) for tot in total]
    qh = 2 if with_min else 1  # index of the first qh field
    with e.chunks() as c:
        h_lo = e.load(s, e.rows(so, c, qh), I16, e.L)
        h_hi = e.load(s, e.rows(so, c, qh + 1), I16, e.L)
        isum = [e.zero32()] * len(toks)
        acc16 = [e.zero16()] * len(toks)
        for jp in range(8):
            v = e.qpair(q, qo, c, jp)
            lo = b.or_(e.nibbles(v, False), e.bits16(h_lo, 4 - jp, 0x1010))
            hi = b.or_(e.nibbles(v, True), e.bits16(h_hi, 4 - jp, 0x1010))
            for i, t in enumerate(toks):
                acc16[i] = b.add(acc16[i], e.maddubs(lo, e.xpair(xq, t, 2 * jp)))
                acc16[i] = b.add(acc16[i], e.maddubs(hi, e.xpair(xq, t, 16 + 2 * jp)))
                if jp % 2 == 1:
                    isum[i] = b.add(isum[i], e.widen(acc16[i]))
                    acc16[i] = e.zero16()
        d = e.halves(s, e.rows(so, c))
        m = e.halves(s, e.rows(so, c, 1)) if with_min else None
        for i, t in enumerate(toks):
            if with_min:
                part = b.fadd(b.fmul(d, b.fmul(d_x[i], e.to_float(isum[i]))), b.fmul(m, sx[i]))
            else:
                part = b.fmul(d, b.fmul(d_x[i], e.to_float(b.sub(isum[i], offset[i]))))
            e.add_to_acc(acc, t, c, part)


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][qh u32][qs 16]: d · (q - 16), bit 4 of value j from bit j of qh
    d = arrays.half(xp, b[:, 0:2])  # (n, 1)
    q = arrays.nibbles(xp, b[:, 6:22]) | (arrays.bits(xp, arrays.u32(xp, b[:, 2:6]), 32) << 4)  # (n, 32)
    return d * (q.astype(xp.int8) - 16).astype(xp.float32)


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    dot=dot,
    packing=PACKING,
    group=group,
    emitters={PAIRS: partial(emit_q5_pairs, with_min=False)},
)
