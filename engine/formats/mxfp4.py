"""MXFP4: blocks of 32 values, 17 bytes: e (E8M0) | qs[16]; value j = 2**(e - 128) · kvalues[nibble j], nibbles
low then high (IQ4_NL's layout), through ggml's `kvalues_mxfp4` (gguf.quants.MXFP4.kvalues): the E2M1 values
0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6 doubled to integers, which the halved scale (`ggml_e8m0_to_fp32_half`) undoes.

The scale is a power of two from 2**-128 to 2**127: exact in float32 (2**-128 a subnormal), out of a half's
range. Packed: q = qs[16]; s = the scale as bfloat16 bits (float32's top half, exact for every e), filled by the
repack since 17-byte blocks have no 16-bit field to copy. The kernels are IQ4_NL's (iq4_nl.py: the codebook
looked up with a byte shuffle), given this codebook and the bfloat16 scales.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import MXFP4 as _GGUF_MXFP4
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import arrays
from .arrays import Array
from .emit import PAIRS, QUADS, Emitter
from .fields import INLINE, ROWS, qbyte, set_qbyte
from .iq4_nl import Codebook, block_emitter, codebook, run_sum
from .spec import Format, Packing

TYPE = T.MXFP4

KVALUES = np.array(_GGUF_MXFP4.kvalues, dtype=np.int8)  # (16,): ggml's kvalues_mxfp4, -12 .. 12
BOOK = Codebook(tuple(int(v) for v in KVALUES), 12)  # stored 0 .. 24


def _i32(builder: ir.IRBuilder, v: ir.Value, ty: types.Integer) -> ir.Value:
    """An integer LLVM value as 32 bits: zero-extended or truncated."""
    i32 = ir.IntType(32)
    if ty.bitwidth < 32:
        return builder.zext(v, i32)
    return builder.trunc(v, i32) if ty.bitwidth > 32 else v


@intrinsic
def _scale_bits(typingctx, e):
    """The float32 bits of 2**(e - 128) for the E8M0 byte e, as ggml_e8m0_to_fp32_half builds them: e < 2 are
    subnormals (0x00200000 << e), the others the exponent e - 1."""
    if not isinstance(e, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = builder.and_(_i32(builder, args[0], e), ir.Constant(i32, 255))
        small = builder.shl(ir.Constant(i32, 0x00200000), v)
        normal = builder.shl(builder.sub(v, ir.Constant(i32, 1)), ir.Constant(i32, 23))
        return builder.select(builder.icmp_unsigned("<", v, ir.Constant(i32, 2)), small, normal)

    return types.int32(e), codegen


@intrinsic
def _as_float(typingctx, i):
    """The float32 whose bit pattern is the low 32 bits of the integer i."""
    if not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(_i32(builder, args[0], i), ir.FloatType())

    return types.float32(i), codegen


@njit(**INLINE)
def scale(e):
    """2**(e - 128) as float32, exact: the E8M0 byte e's halved scale."""
    return _as_float(_scale_bits(e))


@njit(**INLINE)
def bf16_value(h):
    """The float32 of bfloat16 bits h (a uint16 of s)."""
    return _as_float(np.uint32(h) << np.uint32(16))


# ---- reference: the file's block, decoded and dotted ---------------------------------------------------------


@njit(**INLINE)
def deq(row, o, f16, out, p):
    """The block at row[o:] -> out[p : p + 32] float32."""
    d = scale(row[o])
    for j in range(16):
        q = np.int32(row[o + 1 + j])
        out[p + j] = d * np.float32(KVALUES[q & 15])
        out[p + j + 16] = d * np.float32(KVALUES[q >> 4])


@njit(**INLINE)
def dot(row, o, f16, x, p):
    """sum(block at row[o:] * x[p : p + 32]), without materialising the block."""
    s = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 1 + j])
        s += np.float32(KVALUES[q & 15]) * x[p + j] + np.float32(KVALUES[q >> 4]) * x[p + j + 16]
    return scale(row[o]) * s


# ---- packed: the layout the SIMD kernels read, and its kernel as plain loops ---------------------------------


@njit(inline="always", cache=True, nogil=True)
def repack(row, o, q, s, g, b, r):
    """qs[16] byte by byte (at an odd offset: no word copy reaches it), and the scale's bfloat16 bits to s."""
    for j in range(16):
        set_qbyte(q, g, b, j, r, row[o + 1 + j])
    s[g, b, 0, r] = np.uint16(_scale_bits(row[o]) >> 16)


@njit(inline="always", cache=True, nogil=True)
def unpack(q, s, g, b, r, out, o):
    """The file's block back: e from the scale's bits (the inverse of `_scale_bits`), then qs."""
    h = np.int32(s[g, b, 0, r])
    out[o] = 0 if h == 0x0020 else 1 if h == 0x0040 else (h >> 7) + 1
    for j in range(16):
        out[o + 1 + j] = qbyte(q, g, b, j, r)


PACKING = Packing(16, (), (), repack, unpack, filled=1)


@njit(inline="always", cache=True, nogil=True)
def group(q, s, g, xq, dx, xsum, acc):
    """acc (ROWS,) += W[g*ROWS : (g+1)*ROWS] @ x̂, the emitters' arithmetic as plain loops."""
    isum = np.empty(ROWS, dtype=np.int32)
    for b in range(q.shape[1]):
        run_sum(q, g, b, 0, xq, b, isum, KVALUES)
        d = dx[b]
        for r in range(ROWS):
            acc[r] += bf16_value(s[g, b, 0, r]) * (d * np.float32(isum[r]))


# ---- SIMD emitters: IQ4_NL's, with this codebook and the bfloat16 scales -------------------------------------


_emit = block_emitter(BOOK, Emitter.bf16s)


# ---- any array module (the GPU) ------------------------------------------------------------------------------


def dequantize(xp: ModuleType, b: Array) -> Array:
    """Blocks b uint8 (n, block_bytes) -> float32 (n, block), with array module xp."""
    # [e u8][qs 16]: 2**(e - 128) · kvalues[q], the scale built from its bits as ggml_e8m0_to_fp32_half does
    e = b[:, 0:1].astype(xp.uint32)  # (n, 1)
    bits = xp.where(e < 2, xp.uint32(0x00200000) << e, (e - xp.uint32(1)) << xp.uint32(23)).astype(xp.uint32)
    d = xp.ascontiguousarray(bits).view(xp.float32)  # (n, 1)
    return d * codebook(xp, arrays.nibbles(xp, b[:, 1:17]), BOOK)  # (n, 32)


FORMAT = Format(
    TYPE, dequantize=dequantize, deq=deq, dot=dot, packing=PACKING, group=group, emitters={PAIRS: _emit, QUADS: _emit}
)
