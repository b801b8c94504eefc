"""Q3_K: super-blocks of 256 values, 110 bytes: hmask[32] | qs[64] | scales[12] (6-bit, packed) | d (half).

Value n*128 + 32j + l (n < 2, j < 4, l < 32): low 2 bits = bits 2j of qs[32n + l], third bit = bit 4n + j of
hmask[l], minus 4; signed 6-bit scale n*8 + 2j + l // 16.

Packed: q = qs[64], hmask[32], the scales as int8 [16]; s = d. No fused dot: the reference dequantizes a
super-block, then dots it.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit

from . import arrays
from .arrays import Array
from .emit import F32, I16, I64, PAIRS, QUADS, Emitter, RunBiases, Token, add_centred_run, dot_runs, splat_const, vt
from .fields import INLINE, ROWS, bits, h2f, half, i8, qbyte, set_qbyte
from .spec import Format, Packing

TYPE = T.Q3_K


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def q3_k_scale(row, o, j):
    """The j-th signed 6-bit scale of a Q3_K block (12 packed bytes at o + 96)."""
    low = (np.int32(row[o + 96 + (j % 8)]) >> (4 * (j // 8))) & 15
    high = (np.int32(row[o + 96 + 8 + (j % 4)]) >> (2 * (j // 4))) & 3
    return (low | (high << 4)) - 32


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 256] float32."""
    # hmask[32] @0, qs[64] @32, scales[12] @96, d @108
    d = half(row, o + 108, f16)
    for n in range(2):
        for j in range(4):
            shift = 2 * j
            bit = n * 4 + j  # which hmask bit plane
            for half_ in range(2):
                dl = d * q3_k_scale(row, o, n * 8 + j * 2 + half_)
                base = p + n * 128 + j * 32 + half_ * 16
                for ll in range(16):
                    k = half_ * 16 + ll
                    q = (np.int32(row[o + 32 + n * 32 + k]) >> shift) & 3
                    hm = (np.int32(row[o + k]) >> bit) & 1
                    out[base + ll] = dl * (q - (1 - hm) * 4)


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


@njit(inline="always", cache=True, nogil=True)
def repack(row, o, q, s, g, b, r):
    """The 12 packed scale bytes decoded to 16 int8 scales at q[96:112]."""
    for j in range(16):
        set_qbyte(q, g, b, 96 + j, r, np.uint8(q3_k_scale(row, o, j) & 255))


@njit(inline="always", cache=True, nogil=True)
def unpack(q, s, g, b, r, out, o):
    """The 6-bit scales re-encoded (the inverse of q3_k_scale)."""
    for j in range(4):  # scales j, 4 + j, 8 + j, 12 + j, back to 0..63
        s0 = np.int32(i8(qbyte(q, g, b, 96 + j, r))) + 32
        s1 = np.int32(i8(qbyte(q, g, b, 100 + j, r))) + 32
        s2 = np.int32(i8(qbyte(q, g, b, 104 + j, r))) + 32
        s3 = np.int32(i8(qbyte(q, g, b, 108 + j, r))) + 32
        out[o + 96 + j] = np.uint8((s0 & 15) | ((s2 & 15) << 4))
        out[o + 100 + j] = np.uint8((s1 & 15) | ((s3 & 15) << 4))
        out[o + 104 + j] = np.uint8((s0 >> 4) | ((s1 >> 4) << 2) | ((s2 >> 4) << 4) | ((s3 >> 4) << 6))


PACKING = Packing(112, ((32, 0, 64), (0, 64, 32)), (108,), repack, unpack)


@njit(inline="always", cache=True, nogil=True)
def _group(q, s, g, xq, dx, xsum, acc, isum, fd):
    for b in range(q.shape[1]):
        fd[:] = 0
        for n in range(2):  # 128-value halves: qs[n*32 : n*32 + 32]
            for j in range(4):  # values n*128 + 32j + ll: bits 2j of qs[n*32 + ll], bit 4n + j of hmask[ll]
                xb = b * 8 + n * 4 + j
                d = dx[xb]
                for h in range(2):  # 16-value runs, each with its own scale
                    isum[:] = 0
                    for m in range(16):
                        ll = 16 * h + m
                        xv = np.int32(xq[xb, ll])
                        for r in range(ROWS):
                            v = bits(qbyte(q, g, b, 32 * n + ll, r), 2 * j, 3)
                            v |= bits(qbyte(q, g, b, 64 + ll, r), 4 * n + j, 1) << 2
                            isum[r] += v * xv
                    off = np.int32(4 * xsum[xb, h])  # the -4 of every value
                    sc = 96 + n * 8 + 2 * j + h
                    for r in range(ROWS):
                        fd[r] += d * np.float32(np.int32(i8(qbyte(q, g, b, sc, r)) * np.int32(isum[r] - off)))
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * fd[r]


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    fd = np.empty(ROWS, dtype=np.float32)
    _group(q, s, g, xq, dx, xsum, acc, isum, fd)


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


# Pairs: qs[64] (pairs 0-31), hmask[32] (pairs 32-47), int8 scales[16] (pairs 48-55).
# Value n*128 + 32j + l (n < 2, j < 4, l < 32): low 2 bits = bits 2j of qs[32n + l], third bit = bit 4n + j
# of hmask[l], minus 4; scale n*8 + 2j + l // 16. Values <= 7: a 16-value run (8 pairs) per 16-bit
# accumulator (<= 14224), then scaled and widened (|scale| <= 32).
def emit_pairs(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
    b = e.b
    with e.chunks() as c:
        fd = [splat_const(F32, e.L, 0.0)] * len(toks)  # in parity order (`scaled_sums`)
        for n in range(2):
            for j in range(4):
                for h in range(2):  # 16-value runs with their own scale
                    idx = n * 8 + 2 * j + h  # scale index
                    sc16 = b.sext(e.even_odd_bytes(e.qpair(q, qo, c, 48 + idx // 2))[idx % 2], vt(I16, e.L))
                    scale = e.by_parity(sc16)
                    scale4 = e.by_parity(b.mul(sc16, splat_const(I16, e.L, 4)))  # |4 * scale| <= 128
                    acc16 = [e.zero16()] * len(toks)
                    for pp in range(8):
                        ll = h * 16 + 2 * pp
                        low = e.bits16(e.qpair16(q, qo, c, (32 * n + ll) // 2), -2 * j, 0x0303)
                        high = e.bits16(e.qpair16(q, qo, c, 32 + ll // 2), 2 - (4 * n + j), 0x0404)
                        v = b.or_(low, high)
                        for i, t in enumerate(toks):
                            acc16[i] = b.add(acc16[i], e.maddubs(v, e.xpair(xq, t, (4 * n + j) * 32 + ll)))
                    for i, t in enumerate(toks):
                        blk = e.at(t.xb, n * 4 + j)
                        # the -4 of every value: scale * 4 * sum(xq) over these 16 (|sum| <= 2032)
                        off16 = e.load_scalar(xsum, e.at(b.mul(blk, ir.Constant(I64, 2)), h))
                        off = e.scaled_sums(e.splat(b.trunc(off16, I16), e.L), scale4)
                        isum = e.scaled_sums(acc16[i], scale)
                        d_x = e.fsplat(e.load_scalar(dx, blk))
                        fd[i] = b.fadd(fd[i], b.fmul(d_x, e.to_float(b.sub(isum, off))))
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fmul(d, e.from_parity(fd[i])))


def emit_quads(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
    """Q3_K: quads 0-15 qs, 16-23 hmask, 24-27 int8 scales[16].

    A run's 16 values (0..7: the low 2 bits and the hmask bit, the -4 taken off the integer sum as in the pair
    emitter) are 4 quads, one vpdpbusd each per token; the same integers and floats, in the same order, as
    the pair emitter's.
    """
    b = e.b
    biases = RunBiases(e, toks, xsum, 16, 4)  # values + 4
    with e.chunks() as c:
        e.reload_barrier()  # the biases are read in the loop, not held in registers
        fd = [splat_const(F32, e.L, 0.0)] * len(toks)
        for n in range(2):
            for j in range(4):
                for h in range(2):  # 16-value runs with their own scale
                    idx = n * 8 + 2 * j + h  # scale index
                    scale = e.byte_of(e.qquad32(q, qo, c, 24 + idx // 4), idx % 4, True)
                    quads = []
                    for pq in range(4):
                        ll = h * 16 + 4 * pq
                        low = e.bits32(e.qquad32(q, qo, c, 8 * n + ll // 4), -2 * j, 0x03030303)
                        high = e.bits32(e.qquad32(q, qo, c, 16 + ll // 4), 2 - (4 * n + j), 0x04040404)
                        quads.append((b.or_(low, high), (4 * n + j) * 32 + ll))
                    isums = dot_runs(e, toks, xq, quads)
                    add_centred_run(e, fd, isums, toks, dx, n * 4 + j, h, biases, scale)  # values - 4
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fmul(d, fd[i]))


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [hmask 32][qs 64: 2 low bits][scales 12: 6-bit, packed][d f16]
    n = b.shape[0]
    d = arrays.half(xp, b[:, 108:110])  # (n, 1)
    lo = (b[:, 96:104].reshape(n, 1, 8) >> arrays.shifts(xp, 0, 4)[0]).reshape(n, 16)
    hi = (b[:, 104:108].reshape(n, 1, 4) >> arrays.shifts(xp, 0, 2, 4, 6)[0]).reshape(n, 16)
    scales = (lo & 15) | ((hi & 3) << 4)  # (n, 16) in 0..63
    dl = (d * (scales.astype(xp.int8) - 32).astype(xp.float32)).reshape(n, 16, 1)
    ql = (b[:, 32:96].reshape(n, 2, 1, 32) >> arrays.shifts(xp, 0, 2, 4, 6)).reshape(n, 16, 16) & 3
    qh = (b[:, 0:32].reshape(n, 1, 1, 32) >> arrays.shifts(xp, *range(8))).reshape(n, 16, 16) & 1
    q = ql.astype(xp.int8) - ((qh ^ 1) << 2).astype(xp.int8)  # a clear hmask bit subtracts 4
    return (dl * q.astype(xp.float32)).reshape(n, arrays.QK_K)


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    packing=PACKING,
    group=group,
    emitters={PAIRS: emit_pairs, QUADS: emit_quads},
    quad_byte_max=7,
    prefetch=True,
)
