"""Reading the fields of GGUF blocks, and of their packed form, from Numba: the helpers every format shares.

A weight row is stored as raw bytes (`row`: uint8, the row's blocks back to back); a block starts at byte offset
`o`. Each format's dequantizers (<type>.py here) read their fields with these.

`f16` is the 65536-entry table that maps IEEE half bit patterns to float32 (`F16_TABLE`): a table lookup is
cheaper than decoding the bits in Numba, and every format stores its scales as halves.

The packed layout (engine/kernels/packed.py) regroups ROWS rows: `qbyte` reads byte k of a block of one row
there, and `h2f`, `bits` are the 32-bit operations its plain-loop kernels are written with.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

ROWS = 64  # rows per group of the packed layout

INLINE = {"inline": "always", "cache": True, "nogil": True, "fastmath": False}


@njit(**INLINE)
def half(row, o, f16):
    """The float32 value of the little-endian half at row[o:o+2]."""
    return f16[np.int32(row[o]) | (np.int32(row[o + 1]) << 8)]


@njit(**INLINE)
def u32(row, o):
    return (
        np.uint32(row[o]) | (np.uint32(row[o + 1]) << 8) | (np.uint32(row[o + 2]) << 16) | (np.uint32(row[o + 3]) << 24)
    )


@njit(**INLINE)
def i8(b):
    """Reinterpret an unsigned byte as signed."""
    return (np.int32(b) ^ 128) - 128


# ---- the packed layout ----------------------------------------------------------------------------------


@intrinsic
def h2f(typingctx, h):
    """The float32 value of half bit pattern h (any integer type; its low 16 bits), exact like F16_TABLE.

    Written in LLVM IR so that every operation stays 32 bits wide and vectorizes (Numba would widen the
    integer ops to 64 bits): the sign and the 15 magnitude bits shifted into place read as a float32 2**-112
    times the value, subnormals included; exponent 31 (inf, nan) becomes float32's 255.
    """
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        f32 = ir.FloatType()
        v = args[0]
        if h.bitwidth < 32:
            v = builder.zext(v, i32)
        elif h.bitwidth > 32:
            v = builder.trunc(v, i32)
        mag = builder.shl(builder.and_(v, ir.Constant(i32, 0x7FFF)), ir.Constant(i32, 13))
        sign = builder.shl(builder.and_(v, ir.Constant(i32, 0x8000)), ir.Constant(i32, 16))
        bits = builder.or_(mag, sign)
        finite = builder.fmul(builder.bitcast(bits, f32), ir.Constant(f32, 2.0**112))
        special = builder.bitcast(builder.or_(bits, ir.Constant(i32, 0x7F800000)), f32)
        exp31 = builder.icmp_unsigned("==", builder.and_(v, ir.Constant(i32, 0x7C00)), ir.Constant(i32, 0x7C00))
        return builder.select(exp31, special, finite)

    return types.float32(h), codegen


@intrinsic
def bits(typingctx, x, shift, mask):
    """(x >> shift) & mask in 32-bit integers (Numba widens shifts by a variable to 64 bits, which blocks SIMD)."""
    if not all(isinstance(t, types.Integer) for t in (x, shift, mask)):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v, k, m = (
            a if t.bitwidth == 32 else (builder.trunc(a, i32) if t.bitwidth > 32 else builder.zext(a, i32))
            for a, t in zip(args, signature.args, strict=True)
        )
        return builder.and_(builder.lshr(v, k), m)

    return types.int32(x, shift, mask), codegen


@intrinsic
def log2_exact(typingctx, n):
    """log2 of a power of two n (its trailing zero bits: one instruction)."""
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return n(n), codegen


@njit(inline="always", cache=True, nogil=True)
def qbyte(q, g, b, k, r):
    """Byte k of block b of row g*ROWS + r in the packed q (any layout: L and W are q's last two axes, powers of
    two). Shifts and masks, not divisions: packing writes every scale byte through set_qbyte, and four integer
    divisions a byte made a Q4_K expert's repack of its scales take 0.5 ms (0.2 with shifts found by a loop,
    0.05 with log2_exact's one instruction)."""
    n, w = q.shape[4], q.shape[5]
    sn, sw = log2_exact(n), log2_exact(w)
    return q[g, b, r >> sn, k >> sw, r & (n - 1), k & (w - 1)]


@njit(inline="always", cache=True, nogil=True)
def set_qbyte(q, g, b, k, r, v):
    """qbyte(q, g, b, k, r) = v."""
    n, w = q.shape[4], q.shape[5]
    sn, sw = log2_exact(n), log2_exact(w)
    q[g, b, r >> sn, k >> sw, r & (n - 1), k & (w - 1)] = v
