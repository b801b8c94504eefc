"""Q4_0: blocks of 32 values, 18 bytes: d (half) | qs[16]; value j = d * (nibble j - 8), nibbles low then high.

Packed: q = qs[16], s = d.
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
from .emit import F32, I32, PAIRS, QUADS, Emitter, Token, dot_runs, xsum32
from .fields import INLINE, ROWS, h2f, half, qbyte
from .spec import Format, Packing

TYPE = T.Q4_0


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 32] float32."""
    d = half(row, o, f16)
    for j in range(16):
        q = np.int32(row[o + 2 + j])
        out[p + j] = d * ((q & 15) - 8)
        out[p + j + 16] = d * ((q >> 4) - 8)


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 32]), without materialising the block."""
    s = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 2 + j])
        s += ((q & 15) - 8) * x[p + j] + ((q >> 4) - 8) * x[p + j + 16]
    return half(row, o, f16) * s


@njit(cache=True, nogil=True)
def quantize_blocks(x, d, qs):
    """x float32 (n, 32·nb) -> d float32 (n, nb) and qs uint8 (n, nb, 16): ggml's quantize_row_q4_0_ref (the
    value of largest magnitude, the first of equals, maps to -8), so that d rounded to half gives its bytes."""
    for r in range(x.shape[0]):
        for b in range(d.shape[1]):
            p = 32 * b
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for j in range(32):
                v = x[r, p + j]
                if amax < abs(v):
                    amax = abs(v)
                    vmax = v
            scale = vmax / np.float32(-8.0)
            inv = np.float32(1.0) / scale if scale != 0 else np.float32(0.0)
            d[r, b] = scale
            for j in range(16):
                lo = min(15, np.int32(x[r, p + j] * inv + np.float32(8.5)))
                hi = min(15, np.int32(x[r, p + j + 16] * inv + np.float32(8.5)))
                qs[r, b, j] = np.uint8(lo | (hi << 4))


def quantize(x: np.ndarray) -> np.ndarray:
    """x float32 (n, cols), cols a multiple of 32 -> the blocks uint8 (n, cols/32 · 18), as ggml writes them."""
    n, nb = x.shape[0], x.shape[1] // 32
    d = np.empty((n, nb), dtype=np.float32)
    qs = np.empty((n, nb, 16), dtype=np.uint8)
    quantize_blocks(np.ascontiguousarray(x, dtype=np.float32), d, qs)
    out = np.empty((n, nb, 18), dtype=np.uint8)
    out[..., :2] = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    out[..., 2:] = qs
    return out.reshape(n, nb * 18)


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


PACKING = Packing(16, ((2, 0, 16),), (0,))


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
        off = np.int32(8 * (xsum[b, 0] + xsum[b, 1]))  # the -8 of every value
        d = dx[b]
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(np.int32(isum[r] - off)))


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    _group(q, s, g, xq, dx, xsum, acc, isum)


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


# Pairs: 16 bytes, 8 pairs; value = nibble (- 8 for Q4_0; Q4_1 shares these with its min).
# Each pmaddubsw sums 2 products <= 15 * 127; 8 pairs per accumulator: <= 30480, no saturation.
def emit_q4_pairs(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token], with_min: bool) -> None:
    b = e.b
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    total = [xsum32(e, xsum, t.xb) for t in toks]
    if with_min:  # the min term: m * sum(x̂)
        sx = [e.fsplat(b.fmul(e.load_scalar(dx, t.xb), b.sitofp(tot, F32))) for t, tot in zip(toks, total, strict=True)]
    else:  # every value is nibble - 8
        offset = [e.splat(b.mul(tot, ir.Constant(I32, 8)), e.L) for tot in total]
    with e.chunks() as c:
        acc_lo, acc_hi = [e.zero16()] * len(toks), [e.zero16()] * len(toks)
        for jp in range(8):  # byte pair (2jp, 2jp+1): low nibbles are values 2jp.., high ones 16 + 2jp..
            v = e.qpair(q, qo, c, jp)
            lo, hi = e.nibbles(v, False), e.nibbles(v, True)
            for i, t in enumerate(toks):
                acc_lo[i] = b.add(acc_lo[i], e.maddubs(lo, e.xpair(xq, t, 2 * jp)))
                acc_hi[i] = b.add(acc_hi[i], e.maddubs(hi, e.xpair(xq, t, 16 + 2 * jp)))
        d = e.halves(s, e.rows(so, c))
        m = e.halves(s, e.rows(so, c, 1)) if with_min else None
        for i, t in enumerate(toks):
            isum = b.add(e.widen(acc_lo[i]), e.widen(acc_hi[i]))  # (16,) i32: per row, nibble . xq
            if not with_min:
                isum = b.sub(isum, offset[i])
            part = b.fmul(d, b.fmul(d_x[i], e.to_float(isum)))
            if with_min:
                part = b.fadd(part, b.fmul(m, sx[i]))
            e.add_to_acc(acc, t, c, part)


# Quads (vpdpbusd): the same integer sums, in 32 bits directly, then the same float operations in the same order.


def emit_q4_quads(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token], with_min: bool) -> None:
    b = e.b
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    total = [xsum32(e, xsum, t.xb) for t in toks]
    if with_min:
        sx = [e.fsplat(b.fmul(e.load_scalar(dx, t.xb), b.sitofp(tot, F32))) for t, tot in zip(toks, total, strict=True)]
    else:
        offset = [e.splat(b.mul(tot, ir.Constant(I32, 8)), e.L) for tot in total]
    with e.chunks() as c:
        quads = []
        for jq in range(4):  # bytes 4jq..4jq+3: low nibbles are values 4jq.., high ones 16 + 4jq..
            v = e.qvec(q, qo, c, jq)
            quads += [(e.nibbles(v, False), 4 * jq), (e.nibbles(v, True), 16 + 4 * jq)]
        isums = dot_runs(e, toks, xq, quads)
        d = e.halves(s, e.rows(so, c))
        m = e.halves(s, e.rows(so, c, 1)) if with_min else None
        for i, t in enumerate(toks):
            isum = isums[i] if with_min else b.sub(isums[i], offset[i])
            part = b.fmul(d, b.fmul(d_x[i], e.to_float(isum)))
            if with_min:
                part = b.fadd(part, b.fmul(m, sx[i]))
            e.add_to_acc(acc, t, c, part)


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][qs 16]: d · (q - 8)
    d = arrays.half(xp, b[:, 0:2])  # (n, 1)
    q = arrays.nibbles(xp, b[:, 2:18]).astype(xp.int8) - 8  # (n, 32)
    return d * q.astype(xp.float32)


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    dot=dot,
    packing=PACKING,
    group=group,
    quantize=quantize,
    emitters={PAIRS: partial(emit_q4_pairs, with_min=False), QUADS: partial(emit_q4_quads, with_min=False)},
    quad_byte_max=15,
)
