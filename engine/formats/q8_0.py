"""Q8_0: blocks of 32 values, 34 bytes: d (half) | qs[32] (int8); value j = d * qs[j].

Packed: q = qs[32], s = d.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit

from . import arrays
from .arrays import Array
from .emit import I8, I16, I32, PAIRS, QUADS, Emitter, Token, dot_runs, splat_const, vt, xsum32
from .fields import INLINE, ROWS, h2f, half, i8, qbyte
from .spec import Format, Packing

TYPE = T.Q8_0


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 32] float32."""
    d = half(row, o, f16)
    for j in range(32):
        out[p + j] = d * i8(row[o + 2 + j])


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 32]), without materialising the block."""
    s = np.float32(0.0)
    for j in range(32):
        s += i8(row[o + 2 + j]) * x[p + j]
    return half(row, o, f16) * s


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


PACKING = Packing(32, ((2, 0, 32),), (0,))


@njit(inline="always", cache=True, nogil=True)
def _group(q, s, g, xq, dx, xsum, acc, isum):
    for b in range(q.shape[1]):
        isum[:] = 0
        for j in range(32):
            xv = np.int32(xq[b, j])
            for r in range(ROWS):
                isum[r] += i8(qbyte(q, g, b, j, r)) * xv
        d = dx[b]
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(isum[r]))


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    _group(q, s, g, xq, dx, xsum, acc, isum)


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


# Pairs: 32 signed bytes, 16 pairs; pmaddwd on bytes widened to 16 bits.
def emit_pairs(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
    b = e.b
    n = e.L  # 16-bit values in half a register's rows: L/2 rows x 2
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    # per token, the 16 pairs widened; the pattern repeats, so half the rows' worth (<L x i16>) is enough
    xpairs = [
        [e.shuffle(b.sext(e.xpair(xq, t, 2 * jp), vt(I16, 2 * n)), list(range(n))) for jp in range(16)] for t in toks
    ]
    with e.chunks() as c:
        sums = [[splat_const(I32, n // 2, 0), splat_const(I32, n // 2, 0)] for _ in toks]
        for jp in range(16):
            v = b.sext(e.qpair(q, qo, c, jp), vt(I16, 2 * n))
            parts = [e.shuffle(v, list(range(n * h, n * h + n))) for h in range(2)]  # the first, last L/2 rows
            for i in range(len(toks)):
                for h in range(2):
                    sums[i][h] = b.add(sums[i][h], e.pmaddwd(parts[h], xpairs[i][jp]))
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            isum = e.concat(sums[i][0], sums[i][1])
            e.add_to_acc(acc, t, c, b.fmul(d, b.fmul(d_x[i], e.to_float(isum))))


def emit_quads(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
    """Signed weights: vpdpbusd takes w + 128 (w ^ 0x80) as unsigned, and 128 * sum(x̂) comes off again."""
    b = e.b
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    offset = [e.splat(b.mul(xsum32(e, xsum, t.xb), ir.Constant(I32, 128)), e.L) for t in toks]
    flip = splat_const(I8, 4 * e.L, -128)
    with e.chunks() as c:
        quads = [(b.xor(e.qvec(q, qo, c, jq), flip), 4 * jq) for jq in range(8)]
        isums = dot_runs(e, toks, xq, quads)  # <= 255 * 127 * 32: exact
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            isum = b.sub(isums[i], offset[i])
            e.add_to_acc(acc, t, c, b.fmul(d, b.fmul(d_x[i], e.to_float(isum))))


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][qs int8 32]: d · q
    return arrays.i8(xp, b[:, 2:34]).astype(xp.float32) * arrays.half(xp, b[:, 0:2])


FORMAT = Format(
    TYPE,
    dequantize=dequantize,
    deq=deq,
    dot=dot,
    packing=PACKING,
    group=group,
    emitters={PAIRS: emit_pairs, QUADS: emit_quads},
)
