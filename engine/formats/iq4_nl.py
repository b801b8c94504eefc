"""IQ4_NL: blocks of 32 values, 18 bytes: d (half) | qs[16]; value j = d * kvalues[nibble j], nibbles low then
high (Q4_0's layout), through ggml's non-linear 16-entry codebook `kvalues_iq4nl` (gguf.quants.IQ4_NL.kvalues).

Packed: q = qs[16], s = d (Q4_0's packing). The kernels look the codebook up with a byte shuffle (pshufb), as
ggml's CPU kernels do. IQ4_XS (iq4_xs.py) is super-blocks of 8 of these with 6-bit scales, and shares the codebook
and the lookups.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from llvmlite import ir
from numba import njit

from . import arrays
from .arrays import Array
from .emit import I32, PAIRS, QUADS, Emitter, Token, dot_runs, xsum32
from .fields import INLINE, ROWS, h2f, half, qbyte
from .spec import Format, Packing

TYPE = T.IQ4_NL

KVALUES = np.array(_GGUF_IQ4_NL.kvalues, dtype=np.int8)  # (16,): ggml's kvalues_iq4nl, -127 .. 113
# The kernels multiply unsigned bytes: a value is stored as kvalue + 128 (1 .. 241) and 128 · sum(x̂) taken off
# the integer sum. pmaddubsw sums two products into 16 bits, where 241 · 127 · 2 would saturate: the pair kernels
# split it into its high and low nibble (each <= 15) and multiply both.
BIASED = tuple(int(v) + 128 for v in KVALUES)
BIASED_HI = tuple(v >> 4 for v in BIASED)
BIASED_LO = tuple(v & 15 for v in BIASED)


# ---- reference: the file's block, dequantized and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 32] float32."""
    d = half(row, o, f16)
    for j in range(16):
        q = np.int32(row[o + 2 + j])
        out[p + j] = d * np.float32(KVALUES[q & 15])
        out[p + j + 16] = d * np.float32(KVALUES[q >> 4])


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 32]), without materialising the block."""
    s = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 2 + j])
        s += np.float32(KVALUES[q & 15]) * x[p + j] + np.float32(KVALUES[q >> 4]) * x[p + j + 16]
    return half(row, o, f16) * s


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


PACKING = Packing(16, ((2, 0, 16),), (0,))


@njit(inline="always", cache=True, nogil=True)
def run_sum(q, g, b, qo, xq, xb, isum):
    """isum (ROWS,) = the 32 values at q bytes qo..qo+15 of block b (low nibbles, then high) · xq[xb], exact."""
    isum[:] = 0
    for j in range(16):
        xa = np.int32(xq[xb, j])
        xc = np.int32(xq[xb, j + 16])
        for r in range(ROWS):
            v = np.int32(qbyte(q, g, b, qo + j, r))
            isum[r] += np.int32(KVALUES[v & 15]) * xa + np.int32(KVALUES[v >> 4]) * xc


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    for b in range(q.shape[1]):
        run_sum(q, g, b, 0, xq, b, isum)
        d = dx[b]
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(isum[r]))


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


def pair_sums(e: Emitter, q, qo, c, first: int, xq, toks: list[Token], x_first: int) -> list:
    """Per token, <L x i32>: the 32 values of q pairs first..first+7 (low nibbles, then high) · x̂, exact.

    x_first: the offset of these 32 activations in each token's block. Each value is looked up as its biased
    high and low nibble (BIASED_HI/LO, <= 15): 8 pairs per 16-bit accumulator, <= 8 · 2 · 15 · 127 = 30480, no
    saturation; then 16 · high + low (the caller takes 128 · sum(x̂) off).
    """
    b = e.b
    sums = [e.zero32()] * len(toks)
    for high in (False, True):  # values 0..15 in the low nibbles, 16..31 in the high ones
        acc_h, acc_l = [e.zero16()] * len(toks), [e.zero16()] * len(toks)
        for jp in range(8):
            v = e.nibbles(e.qpair(q, qo, c, first + jp), high)
            vh, vl = e.lookup16(v, BIASED_HI), e.lookup16(v, BIASED_LO)
            for i, t in enumerate(toks):
                x = e.xpair(xq, t, x_first + 16 * high + 2 * jp)
                acc_h[i] = b.add(acc_h[i], e.maddubs(vh, x))
                acc_l[i] = b.add(acc_l[i], e.maddubs(vl, x))
        for i in range(len(toks)):
            part = b.add(b.shl(e.widen(acc_h[i]), e.splat(ir.Constant(I32, 4), e.L)), e.widen(acc_l[i]))
            sums[i] = b.add(sums[i], part)
    return sums


def quad_sums(e: Emitter, q, qo, c, first: int, xq, toks: list[Token], x_first: int) -> list:
    """The same with vpdpbusd (no 16-bit step): one lookup of the biased value, quads first..first+3."""
    quads = []
    for jq in range(4):  # bytes 4jq..4jq+3: low nibbles are values 4jq.., high ones 16 + 4jq..
        v = e.qvec(q, qo, c, first + jq)
        quads += [(e.lookup16(e.nibbles(v, False), BIASED), x_first + 4 * jq)]
        quads += [(e.lookup16(e.nibbles(v, True), BIASED), x_first + 16 + 4 * jq)]
    return dot_runs(e, toks, xq, quads)


def _emit(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
    b = e.b
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    offset = [e.splat(b.mul(xsum32(e, xsum, t.xb), ir.Constant(I32, 128)), e.L) for t in toks]  # the + 128
    with e.chunks() as c:
        if e.W == QUADS:
            isums = quad_sums(e, q, qo, c, 0, xq, toks, 0)
        else:
            isums = pair_sums(e, q, qo, c, 0, xq, toks, 0)
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            isum = b.sub(isums[i], offset[i])
            e.add_to_acc(acc, t, c, b.fmul(d, b.fmul(d_x[i], e.to_float(isum))))


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def codebook(xp: ModuleType, q: Array) -> Array:
    """Indices q (any shape, 0..15) -> their kvalues as float32."""
    return arrays.constant(xp, "float32", tuple(float(v) for v in KVALUES))[q]


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][qs 16]: d · kvalues[q]
    d = arrays.half(xp, b[:, 0:2])  # (n, 1)
    return d * codebook(xp, arrays.nibbles(xp, b[:, 2:18]))  # (n, 32)


FORMAT = Format(
    TYPE, dequantize=dequantize, deq=deq, dot=dot, packing=PACKING, group=group, emitters={PAIRS: _emit, QUADS: _emit}
)
