"""Q4_K: super-blocks of 256 values, 144 bytes: d dmin (halves) | scales[12] (6-bit scales and mins) | qs[128].

Sub-block 2i (32 values) is the low nibbles of qs[32i : 32i + 32], 2i + 1 the high ones; value = d * scale *
nibble - dmin * min.

Packed: q = qs[128], scale[8], min[8] (the 12 packed bytes decoded at packing: +4 bytes per 144); s = d, dmin.
Q5_K (q5_k.py) is this with a fifth bit, and shares its scales, plain loops and pair emitter.
"""

from __future__ import annotations

from functools import partial
from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from . import arrays
from .arrays import Array
from .emit import F32, I8, I16, I32, PAIRS, QUADS, Emitter, Token, dot_runs, splat_const, vt, xsum32
from .fields import INLINE, ROWS, bits, h2f, half, qbyte, set_qbyte
from .spec import Format, Packing

TYPE = T.Q4_K


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def k4_scale_min(row, o, j):
    """Scale and min of sub-block j of a Q4_K/Q5_K block (12 packed bytes at o + 4)."""
    s = o + 4
    if j < 4:
        sc = np.int32(row[s + j]) & 63
        m = np.int32(row[s + j + 4]) & 63
    else:
        sc = (np.int32(row[s + j + 4]) & 15) | ((np.int32(row[s + j - 4]) >> 6) << 4)
        m = (np.int32(row[s + j + 4]) >> 4) | ((np.int32(row[s + j]) >> 6) << 4)
    return sc, m


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 256] float32."""
    # d @0, dmin @2, scales[12] @4, qs[128] @16
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
            q = np.int32(row[o + 16 + j * 32 + ll])
            out[p + j * 64 + ll] = d1 * (q & 15) - mm1
            out[p + j * 64 + 32 + ll] = d2 * (q >> 4) - mm2


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
            q = np.int32(row[o + 16 + j * 32 + ll])
            a = x[b + ll]
            c = x[b + 32 + ll]
            s1 += (q & 15) * a
            s2 += (q >> 4) * c
            x1 += a
            x2 += c
        total += d * (sc1 * s1 + sc2 * s2) - dmin * (m1 * x1 + m2 * x2)
    return total


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


@njit(inline="always", cache=True, nogil=True)
def repack(row, o, q, s, g, b, r):
    """The 12 packed scale bytes decoded to scale[8] at q[128:136], min[8] at q[136:144]."""
    for j in range(8):
        sc, m = k4_scale_min(row, o, j)
        set_qbyte(q, g, b, 128 + j, r, sc)
        set_qbyte(q, g, b, 136 + j, r, m)


@njit(inline="always", cache=True, nogil=True)
def unpack(q, s, g, b, r, out, o):
    """The 6-bit scales and mins re-encoded (the inverse of k4_scale_min)."""
    for j in range(4):
        sc_lo = qbyte(q, g, b, 128 + j, r)
        sc_hi = qbyte(q, g, b, 132 + j, r)
        m_lo = qbyte(q, g, b, 136 + j, r)
        m_hi = qbyte(q, g, b, 140 + j, r)
        out[o + 4 + j] = sc_lo | ((sc_hi >> 4) << 6)
        out[o + 8 + j] = m_lo | ((m_hi >> 4) << 6)
        out[o + 12 + j] = (sc_hi & 15) | ((m_hi & 15) << 4)


PACKING = Packing(144, ((16, 0, 128),), (0, 2), repack, unpack)


# The k-quant kernels keep one accumulator array per inner loop: LLVM vectorizes a loop that stores to one
# array, and gives up on one that stores to several (it cannot rule out that they overlap).


@njit(inline="always", cache=True, nogil=True)
def k_quant_value(q, g, b, k, hi, fifth, r):
    """Value of byte k's low (hi=0) or high nibble in a Q4_K/Q5_K block; Q5_K's fifth bit is bit `fifth` of
    qh[k % 32] (q byte 144 + k % 32); fifth < 0 for Q4_K."""
    v = bits(qbyte(q, g, b, k, r), 4 * hi, 15)
    if fifth >= 0:
        v |= bits(qbyte(q, g, b, 144 + k % 32, r), fifth, 1) << 4
    return v


@njit(inline="always", cache=True, nogil=True)
def group_k_quant(q, s, g, xq, dx, xsum, acc, isum, isum2, fd, fm, fifth_bit):
    """Q4_K, or Q5_K with fifth_bit."""
    for b in range(q.shape[1]):
        fd[:] = 0
        fm[:] = 0
        for c in range(4):  # 64 values: sub-block 2c in the low nibbles, 2c + 1 in the high ones
            lo = b * 8 + 2 * c
            fa = 2 * c if fifth_bit else -1  # Q5_K: qh bit 2c for sub-block 2c, 2c + 1 for 2c + 1
            fb = 2 * c + 1 if fifth_bit else -1
            isum[:] = 0
            for ll in range(32):
                xa = np.int32(xq[lo, ll])
                for r in range(ROWS):
                    isum[r] += k_quant_value(q, g, b, c * 32 + ll, 0, fa, r) * xa
            isum2[:] = 0
            for ll in range(32):
                xb = np.int32(xq[lo + 1, ll])
                for r in range(ROWS):
                    isum2[r] += k_quant_value(q, g, b, c * 32 + ll, 1, fb, r) * xb
            da = dx[lo]
            db = dx[lo + 1]
            for r in range(ROWS):
                sc_a = np.int32(qbyte(q, g, b, 128 + 2 * c, r))
                sc_b = np.int32(qbyte(q, g, b, 129 + 2 * c, r))
                fd[r] += da * np.float32(np.int32(sc_a * isum[r])) + db * np.float32(np.int32(sc_b * isum2[r]))
            sa = da * np.float32(xsum[lo, 0] + xsum[lo, 1])  # the sums of x̂, for the mins
            sb = db * np.float32(xsum[lo + 1, 0] + xsum[lo + 1, 1])
            for r in range(ROWS):
                fm[r] += (
                    np.float32(qbyte(q, g, b, 136 + 2 * c, r)) * sa + np.float32(qbyte(q, g, b, 137 + 2 * c, r)) * sb
                )
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * fd[r] - h2f(s[g, b, 1, r]) * fm[r]


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    t0 = np.empty(ROWS, dtype=np.int32)
    t1 = np.empty(ROWS, dtype=np.int32)
    f0 = np.empty(ROWS, dtype=np.float32)
    f1 = np.empty(ROWS, dtype=np.float32)
    group_k_quant(q, s, g, xq, dx, xsum, acc, t0, t1, f0, f1, False)


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


# Pairs (Q4_K and Q5_K): qs[128] (pairs 0-63), scales[8] (pairs 64-67), mins[8] (pairs 68-71), and for Q5_K
# qh[32] (pairs 72-87).
# Sub-block 2i is the low nibbles of bytes 32i..32i+31, 2i+1 the high ones; Q5_K adds bit 2i (2i + 1) of
# qh[l] as the fifth bit of value l. Q4_K: 8 pairs per 16-bit accumulator (<= 30480); Q5_K (values <= 31):
# 4 pairs (<= 31496); then scaled and widened (scale <= 63).
def emit_k_quant_pairs(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token], fifth_bit: bool) -> None:
    b = e.b
    per_acc = 4 if fifth_bit else 8  # byte pairs per 16-bit accumulator
    with e.chunks() as c:
        fd = [splat_const(F32, e.L, 0.0)] * len(toks)  # in parity order (`scaled_sums`)
        for i in range(4):
            sc = e.even_odd_bytes(e.qpair(q, qo, c, 64 + i))
            for hi in range(2):  # sub-block 2i + hi: the low nibbles of bytes 32i.., then the high ones
                scale = e.by_parity(b.zext(sc[hi], vt(I16, e.L)))
                isum = [e.zero32()] * len(toks)  # scale * (values . xq): <= 63 * 125984
                acc16 = [e.zero16()] * len(toks)
                for pp in range(16):
                    v = e.nibbles(e.qpair(q, qo, c, i * 16 + pp), bool(hi))
                    if fifth_bit:
                        v = b.or_(v, e.bits16(e.qpair16(q, qo, c, 72 + pp), 4 - (2 * i + hi), 0x1010))
                    for k, t in enumerate(toks):
                        acc16[k] = b.add(acc16[k], e.maddubs(v, e.xpair(xq, t, (2 * i + hi) * 32 + 2 * pp)))
                        if pp % per_acc == per_acc - 1:
                            isum[k] = b.add(isum[k], e.scaled_sums(acc16[k], scale))
                            acc16[k] = e.zero16()
                for k, t in enumerate(toks):
                    d_x = e.fsplat(e.load_scalar(dx, e.at(t.xb, 2 * i + hi)))
                    fd[k] = b.fadd(fd[k], b.fmul(d_x, e.to_float(isum[k])))
                e.reload_barrier()
        d = e.halves(s, e.rows(so, c))
        dmin = e.halves(s, e.rows(so, c, 1))
        mins = [e.even_odd_bytes(e.qpair(q, qo, c, 68 + i)) for i in range(4)]
        for k, t in enumerate(toks):
            fm = splat_const(F32, e.L, 0.0)  # the mins against the sums of x̂
            for i in range(4):
                for hi in range(2):
                    blk = e.at(t.xb, 2 * i + hi)
                    sx = b.fmul(e.load_scalar(dx, blk), b.sitofp(xsum32(e, xsum, blk), F32))
                    fm = b.fadd(fm, b.fmul(b.uitofp(mins[i][hi], vt(F32, e.L)), e.fsplat(sx)))
            e.add_to_acc(acc, t, c, b.fsub(b.fmul(d, e.from_parity(fd[k])), b.fmul(dmin, fm)))


def emit_quads(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token], fifth_bit: bool = False) -> None:
    """Q4_K: quads 0-31 qs, 32-33 scales[8], 34-35 mins[8] (one byte per sub-block); Q5_K (fifth_bit) adds
    qh[32] as quads 36-43, bit j of qh[l] the fifth bit of value l of sub-block j (values <= 31).

    With vpdpbusd a Q4_K high nibble is multiplied in place (byte & 0xF0, 16x its value: vpdpbusd has no 16-bit
    step to overflow, and 4 * 240 * 127 per step stays far from 2^31), and the sum shifted right by 4, exactly:
    one instruction a register instead of a shift and a mask. pmaddubsw (`QuadSums`) takes the nibble itself.
    """
    b = e.b
    high = splat_const(I8, 4 * e.L, 0xF0)
    in_place = e.has_dpbusd and not fifth_bit

    def sum_x(t: Token, j: int):  # dx * sum(x̂) of sub-block j, for the mins
        return b.fmul(e.load_scalar(dx, e.at(t.xb, j)), b.sitofp(xsum32(e, xsum, e.at(t.xb, j)), F32))

    # The same for every chunk, so computed once a block; a tile's 8 per token are read from the stack.
    sxs = [sum_x(t, j) for t in toks for j in range(8)]
    stash = e.stash(sxs) if len(toks) > 1 else None
    with e.chunks() as c:
        e.reload_barrier()  # the stash is read in the loop, not held in registers
        fd = [splat_const(F32, e.L, 0.0)] * len(toks)
        for i in range(4):
            for hi in range(2):  # sub-block 2i + hi: the low nibbles of bytes 32i.., then the high ones
                j = 2 * i + hi
                # float(isum) * scale is float(isum * scale) exactly: |isum * scale| <= 32*31*127*63 < 2^24
                scale = b.sitofp(e.byte_of(e.qquad32(q, qo, c, 32 + j // 4), j % 4, False), vt(F32, e.L))
                raw = [e.qvec(q, qo, c, 8 * i + pq) for pq in range(8)]
                if fifth_bit:  # bit j of each qh byte moved to bit 4
                    fifth = [e.bits32(e.qquad32(q, qo, c, 36 + pq), 4 - j, 0x10101010) for pq in range(8)]
                    values = [b.or_(e.nibbles(v, bool(hi)), fifth[pq]) for pq, v in enumerate(raw)]
                else:
                    values = [b.and_(v, high) if hi and in_place else e.nibbles(v, bool(hi)) for v in raw]
                # the eight sub-blocks' sums are eight independent chains: one accumulator each spares the adds
                # that would join more (one token, Zen 5, one thread from L2: 51.6 -> 61.7 GB/s against four)
                isums = dot_runs(e, toks, xq, [(v, j * 32 + 4 * pq) for pq, v in enumerate(values)], chains=1)
                if hi and in_place:
                    isums = [b.ashr(v, splat_const(I32, e.L, 4)) for v in isums]  # every term a multiple of 16
                for k, t in enumerate(toks):
                    d_x = e.fsplat(e.load_scalar(dx, e.at(t.xb, j)))
                    fd[k] = b.fadd(fd[k], b.fmul(d_x, b.fmul(e.to_float(isums[k]), scale)))
                if not e.has_dpbusd:  # else LLVM hoists the next sub-blocks' loads and spills them (16 ymm)
                    e.reload_barrier()
        d = e.halves(s, e.rows(so, c))
        dmin = e.halves(s, e.rows(so, c, 1))
        mins = [e.qquad32(q, qo, c, 34 + h) for h in range(2)]
        mins = [b.sitofp(e.byte_of(mins[j // 4], j % 4, False), vt(F32, e.L)) for j in range(8)]
        for k, t in enumerate(toks):
            fm = splat_const(F32, e.L, 0.0)
            for j in range(8):
                sx = e.unstash(stash, 8 * k + j) if stash is not None else e.fsplat(sxs[8 * k + j])
                fm = b.fadd(fm, b.fmul(mins[j], sx))
            e.add_to_acc(acc, t, c, b.fsub(b.fmul(d, fd[k]), b.fmul(dmin, fm)))


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def scale_min_k4(xp: ModuleType, s: Array) -> tuple[Array, Array]:
    """The 6-bit scales and mins of Q4_K / Q5_K: s uint8 (n, 12) -> two uint8 (n, 8)."""
    n = s.shape[0]
    s = s.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # (n, 4) each
    sc = xp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = xp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][dmin f16][scales 12][qs 128]: 8 sub-blocks of 32, each d·sc·q - dmin·m
    n = b.shape[0]
    d, dmin = arrays.half(xp, b[:, 0:2]), arrays.half(xp, b[:, 2:4])  # (n, 1) each
    sc, mn = scale_min_k4(xp, b[:, 4:16])
    dl = (d * sc.astype(xp.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(xp.float32)).reshape(n, 8, 1)
    q = (b[:, 16:144].reshape(n, 4, 1, 32) >> arrays.shifts(xp, 0, 4)) & 15  # (n, 4, 2, 32)
    return (dl * q.reshape(n, 8, 32).astype(xp.float32) - ml).reshape(n, arrays.QK_K)


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    dot=dot,
    packing=PACKING,
    group=group,
    emitters={PAIRS: partial(emit_k_quant_pairs, fifth_bit=False), QUADS: emit_quads},
    quad_byte_max=15,
)
