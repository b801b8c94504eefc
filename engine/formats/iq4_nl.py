"""IQ4_NL: blocks of 32 values, 18 bytes: d (half) | qs[16]; value j = d * kvalues[nibble j], nibbles low then
high (Q4_0's layout), through ggml's non-linear 16-entry codebook `kvalues_iq4nl` (gguf.quants.IQ4_NL.kvalues).

Packed: q = qs[16], s = d (Q4_0's packing). The kernels look the codebook up with a byte shuffle (pshufb), as
ggml's CPU kernels do. IQ4_XS (iq4_xs.py) is super-blocks of 8 of these with 6-bit scales, and shares the codebook
and the lookups; MXFP4 (mxfp4.py) is these blocks with another codebook and scale, and shares the kernels, which
take the codebook (`Codebook`) and the way to read the scale as parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from llvmlite import ir
from numba import njit

from . import arrays
from .arrays import Array
from .emit import I32, PAIRS, QUADS, Emitter, RunBiases, Token, dot_runs
from .fields import INLINE, ROWS, h2f, half, qbyte
from .spec import Format, Packing

TYPE = T.IQ4_NL

KVALUES = np.array(_GGUF_IQ4_NL.kvalues, dtype=np.int8)  # (16,): ggml's kvalues_iq4nl, -127 .. 113


@dataclass(frozen=True)
class Codebook:
    """A 16-entry codebook of signed values, as the SIMD kernels look it up.

    The kernels multiply unsigned bytes: a value is stored as value + bias (0 .. 255) and bias · sum(x̂) taken off
    the integer sum. pmaddubsw sums two products into 16 bits, where 241 · 127 · 2 would saturate: the pair kernels
    split each stored value into its high and low nibble (each <= 15) and multiply both.
    """

    values: tuple[int, ...]  # the 16 entries, signed
    bias: int  # added to every entry so that all are 0 .. 255

    @property
    def biased(self) -> tuple[int, ...]:
        return tuple(v + self.bias for v in self.values)

    @property
    def hi(self) -> tuple[int, ...]:
        return tuple(v >> 4 for v in self.biased)

    @property
    def lo(self) -> tuple[int, ...]:
        return tuple(v & 15 for v in self.biased)


BOOK = Codebook(tuple(int(v) for v in KVALUES), 128)  # stored 1 .. 241


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
def run_sum(q, g, b, qo, xq, xb, isum, table):
    """isum (ROWS,) = the 32 values at q bytes qo..qo+15 of block b (low nibbles, then high) · xq[xb], exact.

    table: int8 (16,), the codebook (KVALUES here, MXFP4's in mxfp4.py)."""
    isum[:] = 0
    for j in range(16):
        xa = np.int32(xq[xb, j])
        xc = np.int32(xq[xb, j + 16])
        for r in range(ROWS):
            v = np.int32(qbyte(q, g, b, qo + j, r))
            isum[r] += np.int32(table[v & 15]) * xa + np.int32(table[v >> 4]) * xc


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    for b in range(q.shape[1]):
        run_sum(q, g, b, 0, xq, b, isum, KVALUES)
        d = dx[b]
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(isum[r]))


# ---- SIMD emitters, by the width W of a row's bytes side by side (emit.py): one per instruction family -------


def pair_sums(e: Emitter, q, qo, c, first: int, xq, toks: list[Token], x_first: int, book: Codebook = BOOK) -> list:
    """Per token, <L x i32>: the 32 values of q pairs first..first+7 (low nibbles, then high) · x̂, exact.

    x_first: the offset of these 32 activations in each token's block. Each value is looked up as its biased
    high and low nibble (book.hi/lo, <= 15): 8 pairs per 16-bit accumulator, <= 8 · 2 · 15 · 127 = 30480, no
    saturation; then 16 · high + low (the caller takes book.bias · sum(x̂) off).
    """
    b = e.b
    sums = [e.zero32()] * len(toks)
    for high in (False, True):  # values 0..15 in the low nibbles, 16..31 in the high ones
        acc_h, acc_l = [e.zero16()] * len(toks), [e.zero16()] * len(toks)
        for jp in range(8):
            v = e.nibbles(e.qpair(q, qo, c, first + jp), high)
            vh, vl = e.lookup16(v, book.hi), e.lookup16(v, book.lo)
            for i, t in enumerate(toks):
                x = e.xpair(xq, t, x_first + 16 * high + 2 * jp)
                acc_h[i] = b.add(acc_h[i], e.maddubs(vh, x))
                acc_l[i] = b.add(acc_l[i], e.maddubs(vl, x))
        for i in range(len(toks)):
            part = b.add(b.shl(e.widen(acc_h[i]), e.splat(ir.Constant(I32, 4), e.L)), e.widen(acc_l[i]))
            sums[i] = b.add(sums[i], part)
    return sums


def quad_sums(e: Emitter, q, qo, c, first: int, xq, toks: list[Token], x_first: int, book: Codebook = BOOK) -> list:
    """The same with vpdpbusd (no 16-bit step): one lookup of the biased value, quads first..first+3."""
    quads = []
    for jq in range(4):  # bytes 4jq..4jq+3: low nibbles are values 4jq.., high ones 16 + 4jq..
        v = e.qvec(q, qo, c, first + jq)
        quads += [(e.lookup16(e.nibbles(v, False), book.biased), x_first + 4 * jq)]
        quads += [(e.lookup16(e.nibbles(v, True), book.biased), x_first + 16 + 4 * jq)]
    return dot_runs(e, toks, xq, quads)


def block_emitter(book: Codebook, scales: Callable[[Emitter, object, object], object]) -> Callable[..., None]:
    """The emitter of 32-value blocks of 16 codebook nibbles and one per-row scale: IQ4_NL's, MXFP4's.

    scales(e, s, off): the L rows' scales at s[off] as <L x float> (IQ4_NL: halves; MXFP4: bfloat16 bits)."""

    def emit(e: Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[Token]) -> None:
        b = e.b
        biases = RunBiases(e, toks, xsum, 1, book.bias, run=32)  # the stored + bias
        with e.chunks() as c:
            e.reload_barrier()  # the biases are read in the loop, not held in registers
            if e.W == QUADS:
                isums = quad_sums(e, q, qo, c, 0, xq, toks, 0, book)
            else:
                isums = pair_sums(e, q, qo, c, 0, xq, toks, 0, book)
            d = scales(e, s, e.rows(so, c))
            for i, t in enumerate(toks):
                isum = b.sub(isums[i], biases(i, 0))
                d_x = e.fsplat(e.load_scalar(dx, t.xb))
                e.add_to_acc(acc, t, c, b.fmul(d, b.fmul(d_x, e.to_float(isum))))

    return emit


_emit = block_emitter(BOOK, Emitter.halves)


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def codebook(xp: ModuleType, q: Array, book: Codebook = BOOK) -> Array:
    """Indices q (any shape, 0..15) -> their codebook values as float32."""
    return arrays.constant(xp, "float32", tuple(float(v) for v in book.values))[q]


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [d f16][qs 16]: d · kvalues[q]
    d = arrays.half(xp, b[:, 0:2])  # (n, 1)
    return d * codebook(xp, arrays.nibbles(xp, b[:, 2:18]))  # (n, 32)


FORMAT = Format(
    TYPE, dequantize=dequantize, deq=deq, dot=dot, packing=PACKING, group=group, emitters={PAIRS: _emit, QUADS: _emit}
)
