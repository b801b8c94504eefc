"""Q6_K: super-blocks of 256 values, 210 bytes: ql[128] | qh[64] | scales[16] (int8) | d (half).

Value n*128 + 32k + l (n < 2, k < 4, l < 32): low 4 bits = nibble k // 2 of ql[64n + 32(k % 2) + l], high 2
bits = bits 2k of qh[32n + l], minus 32; scale n*8 + 2k + l // 16.

Packed: q = ql[128], qh[64], scales[16] as quads (4-byte words) in the order the one-token kernel first reads
them (`ORDER`); s = d.
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
from .fields import INLINE, ROWS, bits, h2f, half, i8, qbyte
from .spec import Format, Packing, ordered_copies

TYPE = T.Q6_K


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 256] float32."""
    # ql[128] @0, qh[64] @128, scales[16] (int8) @192, d @208
    d = half(row, o + 208, f16)
    for n in range(2):
        ql = o + n * 64
        qh = o + 128 + n * 32
        sc = o + 192 + n * 8
        base = p + n * 128
        for ll in range(32):
            s = ll // 16
            h = np.int32(row[qh + ll])
            a = np.int32(row[ql + ll])
            b = np.int32(row[ql + ll + 32])
            out[base + ll] = d * i8(row[sc + s]) * (((a & 15) | ((h & 3) << 4)) - 32)
            out[base + ll + 32] = d * i8(row[sc + s + 2]) * (((b & 15) | (((h >> 2) & 3) << 4)) - 32)
            out[base + ll + 64] = d * i8(row[sc + s + 4]) * (((a >> 4) | (((h >> 4) & 3) << 4)) - 32)
            out[base + ll + 96] = d * i8(row[sc + s + 6]) * (((b >> 4) | (((h >> 6) & 3) << 4)) - 32)


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 256]), without materialising the block."""
    d = half(row, o + 208, f16)
    total = np.float32(0.0)
    for n in range(2):
        ql = o + n * 64
        qh = o + 128 + n * 32
        sc = o + 192 + n * 8
        base = p + n * 128
        for s in range(2):  # two 16-value halves, each with its own four scales
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for m in range(16):
                ll = s * 16 + m
                h = np.int32(row[qh + ll])
                a = np.int32(row[ql + ll])
                b = np.int32(row[ql + ll + 32])
                s0 += (((a & 15) | ((h & 3) << 4)) - 32) * x[base + ll]
                s1 += (((b & 15) | (((h >> 2) & 3) << 4)) - 32) * x[base + ll + 32]
                s2 += (((a >> 4) | (((h >> 4) & 3) << 4)) - 32) * x[base + ll + 64]
                s3 += (((b >> 4) | (((h >> 6) & 3) << 4)) - 32) * x[base + ll + 96]
            total += (
                i8(row[sc + s]) * s0 + i8(row[sc + s + 2]) * s1 + i8(row[sc + s + 4]) * s2 + i8(row[sc + s + 6]) * s3
            )
    return d * total


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


# q's 52 quads (file order: ql 0-31, qh 32-47, scales 48-51) in memory order: each half n's ql, qh and scale
# quads where the one-token kernel first reads them (`_one_token_runs`: ql 16n + 4h + pq and 16n + 8 + 4h + pq
# with qh 32 + 8n + 4h + pq). Read in file order, three places of a block at once, the hardware prefetcher
# fell behind: 8192-wide matrices from memory (Zen 4, 2 threads) streamed at 0.34 of a plain read, 0.50 with
# software prefetches.
ORDER = [
    quad
    for n in range(2)
    for quad in [
        *(
            j
            for h in range(2)
            for pq in range(4)
            for j in (16 * n + 4 * h + pq, 16 * n + 8 + 4 * h + pq, 32 + 8 * n + 4 * h + pq)
        ),
        48 + 2 * n,
        49 + 2 * n,
    ]
]
SLOT = np.argsort(np.array(ORDER))  # SLOT[j]: q position of file quad j
PACKING = Packing(208, ordered_copies(ORDER), (208,))


@njit(inline="always", cache=True, nogil=True)
def at(k):
    """q offset of byte k of the file's ql|qh|scales."""
    return 4 * SLOT[k >> 2] + (k & 3)


def quad(j: int) -> int:
    """q quad index of the file's quad j (emitters)."""
    return int(SLOT[j])


def pair(jp: int) -> int:
    """q pair index of the file's byte pair jp (pair emitters)."""
    return (4 * int(SLOT[jp // 2]) + 2 * (jp % 2)) // 2


@njit(inline="always", cache=True, nogil=True)
def q6_k_run(q, g, b, lo, hi, shift_lo, shift_hi, xq, xb, ll0, isum):
    """isum += 16 values of a Q6_K block times x̂: low bits in q[lo + ll] >> shift_lo, high in q[hi + ll]."""
    isum[:] = 0
    for m in range(16):
        ll = ll0 + m
        xv = np.int32(xq[xb, ll])
        for r in range(ROWS):
            v = bits(qbyte(q, g, b, at(lo + ll), r), shift_lo, 15) | (
                bits(qbyte(q, g, b, at(hi + ll), r), shift_hi, 3) << 4
            )
            isum[r] += v * xv


@njit(inline="always", cache=True, nogil=True)
def _group(q, s, g, xq, dx, xsum, acc, isum, fd):
    for b in range(q.shape[1]):
        fd[:] = 0
        for n in range(2):  # 128-value halves: ql[n*64 : n*64 + 64], qh[n*32 : n*32 + 32]
            for k in range(4):  # values n*128 + 32k + ll: nibble k // 2 of ql[n*64 + 32 (k % 2) + ll], qh bits 2k
                xb = b * 8 + n * 4 + k
                d = dx[xb]
                for h in range(2):  # 16-value runs, each with its own scale
                    q6_k_run(q, g, b, n * 64 + 32 * (k % 2), 128 + n * 32, 4 * (k // 2), 2 * k, xq, xb, 16 * h, isum)
                    off = np.int32(32 * xsum[xb, h])  # the -32 of every value
                    sc = 192 + n * 8 + h + 2 * k
                    for r in range(ROWS):
                        fd[r] += d * np.float32(np.int32(i8(qbyte(q, g, b, at(sc), r)) * np.int32(isum[r] - off)))
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * fd[r]


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    fd = np.empty(ROWS, dtype=np.float32)
    _group(q, s, g, xq, dx, xsum, acc, isum, fd)


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


# Pairs: ql[128] (pairs 0-63), qh[64] (pairs 64-95), int8 scales[16] (pairs 96-103).
# Value n*128 + 32k + l (n < 2, k < 4, l < 32): low 4 bits = nibble k // 2 of ql[64n + 32(k % 2) + l], high 2
# bits = bits 2k of qh[32n + l], minus 32; scale n*8 + 2k + l // 16. Values <= 63: pmaddubsw pairs <= 16002,
# 2 pairs per 16-bit accumulator (<= 32004), then scaled and widened (|scale * sum| <= 128 * 128016).
def emit_pairs(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
    b = e.b
    with e.chunks() as c:
        fd = [splat_const(F32, e.L, 0.0)] * len(toks)  # in parity order (`scaled_sums`)
        for n in range(2):
            for k in range(4):
                for h in range(2):  # 16-value runs with their own scale
                    j = n * 8 + 2 * k + h  # scale index
                    sc16 = b.sext(e.even_odd_bytes(e.qpair(q, qo, c, pair(96 + j // 2)))[j % 2], vt(I16, e.L))
                    scale = e.by_parity(sc16)
                    scale32 = e.by_parity(b.mul(sc16, splat_const(I16, e.L, 32)))  # |32 * scale| <= 4096
                    isum = [e.zero32()] * len(toks)
                    acc16 = [e.zero16()] * len(toks)
                    for pp in range(8):
                        ll = h * 16 + 2 * pp
                        lp = (64 * n + 32 * (k % 2) + ll) // 2
                        hp = 64 + (32 * n + ll) // 2
                        lo = e.qpair(q, qo, c, pair(lp))
                        hb = e.qpair16(q, qo, c, pair(hp))
                        v = b.or_(e.nibbles(lo, k >= 2), e.bits16(hb, 4 - 2 * k, 0x3030))
                        for i, t in enumerate(toks):
                            acc16[i] = b.add(acc16[i], e.maddubs(v, e.xpair(xq, t, (4 * n + k) * 32 + ll)))
                            if pp % 2 == 1:
                                isum[i] = b.add(isum[i], e.scaled_sums(acc16[i], scale))
                                acc16[i] = e.zero16()
                    for i, t in enumerate(toks):
                        blk = e.at(t.xb, n * 4 + k)
                        # the -32 of every value: scale * 32 * sum(xq) over these 16 (|sum| <= 2032)
                        off16 = e.load_scalar(xsum, e.at(b.mul(blk, ir.Constant(I64, 2)), h))
                        off = e.scaled_sums(e.splat(b.trunc(off16, I16), e.L), scale32)
                        d_x = e.fsplat(e.load_scalar(dx, blk))
                        fd[i] = b.fadd(fd[i], b.fmul(d_x, e.to_float(b.sub(isum[i], off))))
                    e.reload_barrier()
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fmul(d, e.from_parity(fd[i])))


def emit_quads(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
    """Q6_K: quads 0-31 ql, 32-47 qh, 48-51 int8 scales[16].

    One token: in each half n, a quad of ql feeds runs k and k + 2 (its low and high nibbles) and a quad of
    qh all four runs k, so each is loaded once, into 8 sums (k, h) at a time (with vpdpbusd; pmaddubsw's 16 bit
    sums of 8 runs would not fit in the registers). Several tokens (prefill tiles) go run by run instead, so
    that 4 tokens' sums stay in registers. The floats are added in run order
    either way, as the pair emitter adds them.
    """
    b = e.b
    biases = RunBiases(e, toks, xsum, 16, 32)  # values + 32
    with e.chunks() as c:
        e.reload_barrier()  # the biases are read in the loop, not held in registers
        fd = [splat_const(F32, e.L, 0.0)] * len(toks)
        for n in range(2):
            one = _one_token_runs(e, q, qo, c, xq, toks[0], n) if len(toks) == 1 and e.has_dpbusd else None
            for k in range(4):
                for h in range(2):  # 16-value runs with their own scale
                    j = n * 8 + 2 * k + h  # scale index
                    scale = e.byte_of(e.qquad32(q, qo, c, quad(48 + j // 4)), j % 4, True)
                    isums = one[k, h] if one else dot_runs(e, toks, xq, _run_quads(e, q, qo, c, n, k, h))
                    add_centred_run(e, fd, isums, toks, dx, n * 4 + k, h, biases, scale)  # values - 32
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fmul(d, fd[i]))


def _value(e: Emitter, lo, hb, k: int):
    """The 6-bit values of run k from a quad of ql (lo) and one of qh (hb, as 32-bit words)."""
    return e.b.or_(e.nibbles(lo, k >= 2), e.bits32(hb, 4 - 2 * k, 0x30303030))


def _run_quads(e: Emitter, q, qo, c, n: int, k: int, h: int) -> list:
    """Run (n, k, h)'s 4 quads of values, with the offsets of their activations."""
    quads = []
    for pq in range(4):
        ll = h * 16 + 4 * pq
        lo = e.qvec(q, qo, c, quad((64 * n + 32 * (k % 2) + ll) // 4))
        hb = e.qquad32(q, qo, c, quad(32 + (32 * n + ll) // 4))
        quads.append((_value(e, lo, hb, k), (4 * n + k) * 32 + ll))
    return quads


def _one_token_runs(e: Emitter, q, qo, c, xq, tok: Token, n: int) -> dict:
    """Half n's 8 runs' integer sums for one token, {(k, h): [sum]}, each quad of q loaded once."""
    sums = {(k, h): e.zero32() for k in range(4) for h in range(2)}
    for h in range(2):
        for pq in range(4):
            ll = h * 16 + 4 * pq
            lo = [e.qvec(q, qo, c, quad((64 * n + 32 * m + ll) // 4)) for m in range(2)]  # runs k % 2 == m
            hb = e.qquad32(q, qo, c, quad(32 + (32 * n + ll) // 4))
            for k in range(4):
                v = _value(e, lo[k % 2], hb, k)
                sums[k, h] = e.dpbusd(sums[k, h], v, e.xquad(xq, tok, (4 * n + k) * 32 + ll))
    return {key: [v] for key, v in sums.items()}


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [ql 128: low 4 bits][qh 64: high 2 bits][scales int8 16][d f16]: d · sc · (q - 32)
    n = b.shape[0]
    d = arrays.half(xp, b[:, 208:210])  # (n, 1)
    dl = (d * arrays.i8(xp, b[:, 192:208]).astype(xp.float32)).reshape(n, 16, 1)
    ql = ((b[:, 0:128].reshape(n, 2, 1, 64) >> arrays.shifts(xp, 0, 4)) & 15).reshape(n, 8, 32)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> arrays.shifts(xp, 0, 2, 4, 6)) & 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).astype(xp.int8) - 32
    return (dl * q.reshape(n, 16, 16).astype(xp.float32)).reshape(n, arrays.QK_K)


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    dot=dot,
    packing=PACKING,
    group=group,
    emitters={PAIRS: emit_pairs, QUADS: emit_quads},
    quad_byte_max=63,
)
