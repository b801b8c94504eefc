"""Q2_K: super-blocks of 256 values, 84 bytes: scales[16] | qs[64] | d dmin (halves).

Value n*128 + 32j + l (n < 2, j < 4, l < 32) = bits 2j of qs[32n + l]; run n*8 + 2j + l // 16 has its own 4-bit
scale (low nibble of scales[run]) and min (high nibble): W = d * scale * value - dmin * min.

Packed: q = qs[64], scales[16]; s = d, dmin. No fused dot: the reference dequantizes a super-block, then dots it.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit

from . import arrays
from .arrays import Array
from .emit import F32, I16, I64, PAIRS, Emitter, Token, splat_const, vt
from .fields import INLINE, ROWS, bits, h2f, half, qbyte
from .spec import Format, Packing

TYPE = T.Q2_K


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 256] float32."""
    # scales[16] @0, qs[64] @16, d @80, dmin @82
    d = half(row, o + 80, f16)
    dmin = half(row, o + 82, f16)
    for n in range(2):
        for j in range(4):
            shift = 2 * j
            for half_ in range(2):
                sc = np.int32(row[o + n * 8 + j * 2 + half_])
                dl = d * (sc & 15)
                ml = dmin * (sc >> 4)
                base = p + n * 128 + j * 32 + half_ * 16
                for ll in range(16):
                    q = (np.int32(row[o + 16 + n * 32 + half_ * 16 + ll]) >> shift) & 3
                    out[base + ll] = dl * q - ml


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


PACKING = Packing(80, ((16, 0, 64), (0, 64, 16)), (80, 82))


@njit(inline="always", cache=True, nogil=True)
def _group(q, s, g, xq, dx, xsum, acc, isum, fd, fm):
    for b in range(q.shape[1]):
        fd[:] = 0
        fm[:] = 0
        for n in range(2):  # 128-value halves: qs[n*32 : n*32 + 32]
            for j in range(4):  # values n*128 + 32j + ll: bits 2j of qs[n*32 + ll]
                xb = b * 8 + n * 4 + j
                d = dx[xb]
                for h in range(2):  # 16-value runs, each with its own scale and min
                    isum[:] = 0
                    for m in range(16):
                        ll = 16 * h + m
                        xv = np.int32(xq[xb, ll])
                        for r in range(ROWS):
                            isum[r] += bits(qbyte(q, g, b, 32 * n + ll, r), 2 * j, 3) * xv
                    sc = 64 + n * 8 + 2 * j + h
                    for r in range(ROWS):
                        scale_min = np.int32(qbyte(q, g, b, sc, r))
                        fd[r] += d * np.float32(np.int32((scale_min & 15) * isum[r]))
                        fm[r] += d * np.float32(np.int32((scale_min >> 4) * xsum[xb, h]))
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * fd[r] - h2f(s[g, b, 1, r]) * fm[r]


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    fd = np.empty(ROWS, dtype=np.float32)
    fm = np.empty(ROWS, dtype=np.float32)
    _group(q, s, g, xq, dx, xsum, acc, isum, fd, fm)


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


# Pairs: qs[64] (pairs 0-31), scales[16] (pairs 32-39: scale in the low nibble, min high).
# Value n*128 + 32j + l (n < 2, j < 4, l < 32) = bits 2j of qs[32n + l]; run n*8 + 2j + l // 16 has its own
# scale and min: W = d * scale * value - dmin * min. Values <= 3: a run (8 pairs) per 16-bit accumulator
# (<= 6096), scaled and widened (scale <= 15); the two runs of a 32-block meet in one 32-bit sum.
def emit_pairs(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
    b = e.b
    with e.chunks() as c:
        fd = [splat_const(F32, e.L, 0.0)] * len(toks)  # in parity order (`scaled_sums`)
        fm = [splat_const(F32, e.L, 0.0)] * len(toks)  # the mins against the sums of x̂, parity order
        for n in range(2):
            for j in range(4):
                isum = [e.zero32()] * len(toks)
                msum = [e.zero32()] * len(toks)
                for h in range(2):  # 16-value runs with their own scale and min
                    idx = n * 8 + 2 * j + h
                    sc16 = b.zext(e.even_odd_bytes(e.qpair(q, qo, c, 32 + idx // 2))[idx % 2], vt(I16, e.L))
                    scale = e.by_parity(b.and_(sc16, splat_const(I16, e.L, 15)))
                    mn = e.by_parity(b.lshr(sc16, splat_const(I16, e.L, 4)))
                    acc16 = [e.zero16()] * len(toks)
                    for pp in range(8):
                        ll = h * 16 + 2 * pp
                        v = e.bits16(e.qpair16(q, qo, c, (32 * n + ll) // 2), -2 * j, 0x0303)
                        for i, t in enumerate(toks):
                            acc16[i] = b.add(acc16[i], e.maddubs(v, e.xpair(xq, t, (4 * n + j) * 32 + ll)))
                    for i, t in enumerate(toks):
                        blk = e.at(t.xb, n * 4 + j)
                        sx16 = e.load_scalar(xsum, e.at(b.mul(blk, ir.Constant(I64, 2)), h))  # |sum| <= 2032
                        isum[i] = b.add(isum[i], e.scaled_sums(acc16[i], scale))
                        msum[i] = b.add(msum[i], e.scaled_sums(e.splat(b.trunc(sx16, I16), e.L), mn))
                for i, t in enumerate(toks):
                    d_x = e.fsplat(e.load_scalar(dx, e.at(t.xb, n * 4 + j)))
                    fd[i] = b.fadd(fd[i], b.fmul(d_x, e.to_float(isum[i])))
                    fm[i] = b.fadd(fm[i], b.fmul(d_x, e.to_float(msum[i])))
        d = e.halves(s, e.rows(so, c))
        dmin = e.halves(s, e.rows(so, c, 1))
        for i, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fsub(b.fmul(d, e.from_parity(fd[i])), b.fmul(dmin, e.from_parity(fm[i]))))


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [scales 16: 4-bit scale | 4-bit min << 4][qs 64: 2 bits each][d f16][dmin f16]
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = arrays.half(xp, b[:, 80:82]), arrays.half(xp, b[:, 82:84])  # (n, 1) each
    dl = (d * (scales & 15).astype(xp.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(xp.float32)).reshape(n, 16, 1)
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> arrays.shifts(xp, 0, 2, 4, 6)) & 3  # (n, 2, 4, 32)
    q = q.reshape(n, 16, 16).astype(xp.float32)
    return (dl * q - ml).reshape(n, arrays.QK_K)


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    packing=PACKING,
    group=group,
    emitters={PAIRS: emit_pairs},
    prefetch=True,
)
