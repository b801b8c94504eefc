"""Weights repacked for decode: ROWS consecutive rows interleaved, so the inner loops run across rows.

A GGUF row stores its blocks back to back, so a per-row dot reduces 16-32 products per block horizontally,
which Numba compiles poorly (PERF-FACTS: ~2 GB/s). Here W (d, n) is regrouped once, at first use, into

    q  uint8  (G, nb, ROWS/L, QB/W, L, W)  quant bytes: byte k of block b of row g*ROWS + Lc + l
                                           at q[g, b, c, k//W, l, k%W] (`qbyte`)
    s  uint16 (G, nb, NS, ROWS)            the block's 16-bit fields (half-float scales), rows innermost

with G = ceil(d / ROWS) row groups (the last one zero-padded) and nb blocks per row. Rows are innermost, so a
kernel works on L rows at once (one register) with vertical SIMD and no horizontal sums; each row's bytes stay
W together, in pairs for pmaddubsw or quads for vpdpbusd: (L, W) is `layout(code)`, from the kernel set for
this CPU (simd.KERNELS). Each L-row chunk of a block is contiguous, so the kernels read memory in order. The packed form
holds the same bytes as the file (Q4_K: +4 bytes per 144, its 6-bit scales unpacked), so packing does not
grow memory.

Products quantize x per 32 values to int8 first, as llama.cpp does (`quantize_row_q8_0`):
x̂ = dx * xq with dx = max|x| / 127, xq = round(x / dx). Each block's dot is then an exact integer sum, scaled
in float32. `matvec` computes W @ x̂, so it differs from W @ x by at most sum_b (max|x_b| / 254) * |W_row,b|_1.
The drivers (`matvec`, `matvec_serial`, `matvec_many`, `matmul`) run simd.py's block kernels through
`group_simd` (one token) and `group_simd_tile` (simd.TILE tokens sharing each decode of the weights: prefill);
`matvec_reference` runs the same arithmetic as plain loops (`group_*` below): the readable statement of each
format, against which the tests check simd.py.

Per format (raw block layout -> q bytes, s fields):
  Q4_0  18 B: d | qs[16]              q = qs[16]                        s = d
  Q4_1  20 B: d m | qs[16]            q = qs[16]                        s = d, m
  Q5_0  22 B: d | qh[4] | qs[16]      q = qs[16]                        s = d, qh bits 0-15, 16-31 (reordered)
  Q5_1  24 B: d m | qh[4] | qs[16]    q = qs[16]                        s = d, m, qh bits 0-15, 16-31 (reordered)
  Q8_0  34 B: d | qs[32]              q = qs[32]                        s = d
  Q2_K  84 B: sc[16] | qs[64] | d dmin
                                      q = qs[64], sc[16]                s = d, dmin
  Q3_K 110 B: hmask[32] | qs[64] | sc[12] | d
                                      q = qs[64], hmask[32], scale[16]  s = d
  Q4_K 144 B: d dmin | sc[12] | qs    q = qs[128], scale[8], min[8]     s = d, dmin
  Q5_K 176 B: d dmin | sc[12] | qh[32] | qs[128]
                                      q = qs[128], scale[8], min[8], qh[32]   s = d, dmin
  Q6_K 210 B: ql | qh | sc | d        q = ql[128], qh[64], sc[16]       s = d
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import simd
from .blocks import i8, k4_scale_min, q3_k_scale
from .cpu import Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, _deq_row

ROWS = simd.ROWS  # rows per group
TILE = simd.TILE  # tokens per call of a multi-token block kernel (prefill)
PER_ITEM = 16  # tokens per parallel item of `matmul`: a multiple of TILE

# code: (QB quant bytes, byte copies (raw offset, q offset, count), raw offsets of the 16-bit fields)
LAYOUT = {
    Q4_0: (16, ((2, 0, 16),), (0,)),
    Q4_1: (16, ((4, 0, 16),), (0, 2)),
    Q5_0: (16, ((6, 0, 16),), (0, 2, 4)),  # s = d, qh bits 0-15, 16-31 (see qh_order)
    Q5_1: (16, ((8, 0, 16),), (0, 2, 4, 6)),  # s = d, m, qh bits 0-15, 16-31 (see qh_order)
    Q8_0: (32, ((2, 0, 32),), (0,)),
    Q2_K: (80, ((16, 0, 64), (0, 64, 16)), (80, 82)),  # q = qs[64], scales[16]; s = d, dmin
    Q3_K: (112, ((32, 0, 64), (0, 64, 32)), (108,)),  # + the 12 packed scale bytes at 96, as int8 in q[96:112]
    Q4_K: (144, ((16, 0, 128),), (0, 2)),  # + the 12 packed scale bytes at 4, decoded into q[128:144]
    Q5_K: (176, ((48, 0, 128), (16, 144, 32)), (0, 2)),  # as Q4_K, and qh[32] at q[144:176]
    Q6_K: (208, ((0, 0, 208),), (208,)),
}
PACKED_CODES = frozenset(LAYOUT)


def layout(code: int) -> tuple[int, int]:
    """(L rows per register, W bytes of a row side by side) of format `code`'s packed q on this CPU."""
    return simd.KERNELS.layout(code)


def layout_tables(code: int) -> tuple[int, np.ndarray, np.ndarray]:
    qb, copies, halves = LAYOUT[code]
    return qb, np.array(copies, dtype=np.int64).reshape(-1, 3), np.array(halves, dtype=np.int64)


# ---- half floats ----------------------------------------------------------------------------------------


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


@njit(inline="always", cache=True, nogil=True)
def qbyte(q, g, b, k, r):
    """Byte k of block b of row g*ROWS + r in the packed q (any layout: L and W are q's last two axes)."""
    n, w = q.shape[4], q.shape[5]
    return q[g, b, r // n, k // w, r % n, k % w]


@njit(inline="always", cache=True, nogil=True)
def set_qbyte(q, g, b, k, r, v):
    """qbyte(q, g, b, k, r) = v."""
    n, w = q.shape[4], q.shape[5]
    q[g, b, r // n, k // w, r % n, k % w] = v


# ---- activations ----------------------------------------------------------------------------------------


@njit(inline="always", cache=True, nogil=True)
def quantize_x(x):
    """x (n,) float32 -> xq int8 (n/32, 32), dx float32 (n/32,), xsum int32 (n/32, 2): sums of xq per 16."""
    nb = x.shape[0] // 32
    xq = np.empty((nb, 32), dtype=np.int8)
    dx = np.empty(nb, dtype=np.float32)
    xsum = np.empty((nb, 2), dtype=np.int32)
    quantize_into(x, xq, dx, xsum)
    return xq, dx, xsum


@njit(inline="always", cache=True, nogil=True)
def quantize_into(x, xq, dx, xsum):
    """quantize_x, into given arrays."""
    for b in range(x.shape[0] // 32):
        amax = np.float32(0.0)
        finite = True
        for j in range(32):
            a = abs(x[b * 32 + j])
            amax = max(amax, a)
            finite &= a < np.inf
        d = amax / np.float32(127.0) if finite else np.float32(np.nan)  # a nan or inf in x poisons its block
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        for j in range(32):
            xq[b, j] = np.int8(np.round(x[b * 32 + j] * inv))
        for h in range(2):
            t = np.int32(0)
            for j in range(16):
                t += np.int32(xq[b, h * 16 + j])
            xsum[b, h] = t
        dx[b] = d


@njit(inline="always", cache=True, nogil=True)
def double_pairs(xq, xq2):
    """xq int8 (n/32, 32) -> xq2 (n/32, 64): every byte pair twice, so that one 32-bit load broadcasts a pair."""
    for b in range(xq.shape[0]):
        for p in range(16):
            for k in range(2):
                xq2[b, 4 * p + k] = xq[b, 2 * p + k]
                xq2[b, 4 * p + 2 + k] = xq[b, 2 * p + k]


# ---- one group of ROWS rows, per format -----------------------------------------------------------------
# Each fills acc (ROWS,) with W[g*ROWS : (g+1)*ROWS] @ x̂.


@njit(inline="always", cache=True, nogil=True)
def group_q4_0(q, s, g, xq, dx, xsum, acc, isum):
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
def group_q4_1(q, s, g, xq, dx, xsum, acc, isum):
    for b in range(q.shape[1]):
        isum[:] = 0
        for j in range(16):
            xa = np.int32(xq[b, j])
            xb = np.int32(xq[b, j + 16])
            for r in range(ROWS):
                v = np.int32(qbyte(q, g, b, j, r))
                isum[r] += (v & 15) * xa + (v >> 4) * xb
        d = dx[b]
        sx = d * np.float32(xsum[b, 0] + xsum[b, 1])  # sum of x̂ over the block, for the min
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(isum[r])) + h2f(s[g, b, 1, r]) * sx


@njit(inline="always", cache=True, nogil=True)
def group_q5(q, s, g, xq, dx, xsum, acc, isum, with_min):
    """Q5_0 (values - 16), or Q5_1 with its min (s[1]); the qh fields are the last two of s."""
    qh = 2 if with_min else 1
    for b in range(q.shape[1]):
        isum[:] = 0
        for j in range(16):
            xa = np.int32(xq[b, j])
            xb = np.int32(xq[b, j + 16])
            k = (j >> 1) + 8 * (j & 1)
            for r in range(ROWS):
                v = np.int32(qbyte(q, g, b, j, r))
                lo = (v & 15) | (bits(s[g, b, qh, r], k, 1) << 4)  # qh bit j (see qh_order)
                hi = (v >> 4) | (bits(s[g, b, qh + 1, r], k, 1) << 4)  # qh bit j + 16
                isum[r] += lo * xa + hi * xb
        d = dx[b]
        if with_min:
            sx = d * np.float32(xsum[b, 0] + xsum[b, 1])  # sum of x̂ over the block, for the min
            for r in range(ROWS):
                acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(isum[r])) + h2f(s[g, b, 1, r]) * sx
        else:
            off = np.int32(16 * (xsum[b, 0] + xsum[b, 1]))  # the -16 of every value
            for r in range(ROWS):
                acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(np.int32(isum[r] - off)))


@njit(inline="always", cache=True, nogil=True)
def group_q8_0(q, s, g, xq, dx, xsum, acc, isum):
    for b in range(q.shape[1]):
        isum[:] = 0
        for j in range(32):
            xv = np.int32(xq[b, j])
            for r in range(ROWS):
                isum[r] += i8(qbyte(q, g, b, j, r)) * xv
        d = dx[b]
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * (d * np.float32(isum[r]))


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
def group_q2_k(q, s, g, xq, dx, xsum, acc, isum, fd, fm):
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
def group_q3_k(q, s, g, xq, dx, xsum, acc, isum, fd):
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
def q6_k_run(q, g, b, lo, hi, shift_lo, shift_hi, xq, xb, ll0, isum):
    """isum += 16 values of a Q6_K block times x̂: low bits in q[lo + ll] >> shift_lo, high in q[hi + ll]."""
    isum[:] = 0
    for m in range(16):
        ll = ll0 + m
        xv = np.int32(xq[xb, ll])
        for r in range(ROWS):
            v = bits(qbyte(q, g, b, lo + ll, r), shift_lo, 15) | (bits(qbyte(q, g, b, hi + ll, r), shift_hi, 3) << 4)
            isum[r] += v * xv


@njit(inline="always", cache=True, nogil=True)
def group_q6_k(q, s, g, xq, dx, xsum, acc, isum, fd):
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
                        fd[r] += d * np.float32(np.int32(i8(qbyte(q, g, b, sc, r)) * np.int32(isum[r] - off)))
        for r in range(ROWS):
            acc[r] += h2f(s[g, b, 0, r]) * fd[r]


# The group functions are compiled once and called (not inlined) by every driver below, so that their large
# bodies are not compiled again for each driver and for each parallel one's outlined loop.


@njit(cache=True, nogil=True)
def group_reference(q, s, code, g, xq, dx, xsum, acc):
    """acc (ROWS,) = W[g*ROWS : (g+1)*ROWS] @ x̂ for the packed weight (q, s) of format `code`, as loops."""
    acc[:] = 0
    t0 = np.empty(ROWS, dtype=np.int32)
    if code == Q4_0:
        group_q4_0(q, s, g, xq, dx, xsum, acc, t0)
    elif code == Q4_1:
        group_q4_1(q, s, g, xq, dx, xsum, acc, t0)
    elif code == Q5_0:
        group_q5(q, s, g, xq, dx, xsum, acc, t0, False)
    elif code == Q5_1:
        group_q5(q, s, g, xq, dx, xsum, acc, t0, True)
    elif code == Q8_0:
        group_q8_0(q, s, g, xq, dx, xsum, acc, t0)
    elif code == Q4_K or code == Q5_K:
        t1 = np.empty(ROWS, dtype=np.int32)
        f0 = np.empty(ROWS, dtype=np.float32)
        f1 = np.empty(ROWS, dtype=np.float32)
        group_k_quant(q, s, g, xq, dx, xsum, acc, t0, t1, f0, f1, code == Q5_K)
    elif code == Q2_K:
        f0 = np.empty(ROWS, dtype=np.float32)
        f1 = np.empty(ROWS, dtype=np.float32)
        group_q2_k(q, s, g, xq, dx, xsum, acc, t0, f0, f1)
    elif code == Q3_K:
        f0 = np.empty(ROWS, dtype=np.float32)
        group_q3_k(q, s, g, xq, dx, xsum, acc, t0, f0)
    elif code == Q6_K:
        f0 = np.empty(ROWS, dtype=np.float32)
        group_q6_k(q, s, g, xq, dx, xsum, acc, t0, f0)


@njit(cache=True, nogil=True)
def group_simd(q, s, code, g, xq, dx, xsum, acc):
    """acc (ROWS,) = W[g*ROWS : (g+1)*ROWS] @ x̂ for the packed weight (q, s), with simd.py's block kernels."""
    acc[:] = 0
    nb = q.shape[1]
    qstep = q.shape[2] * q.shape[3] * q.shape[4] * q.shape[5]  # bytes per block of the group
    sstep = s.shape[2] * ROWS
    qf = q.reshape(-1)
    sf = s.reshape(-1)
    xf = xq.reshape(-1)
    xsf = xsum.reshape(-1)
    q0 = g * nb * qstep
    s0 = g * nb * sstep
    # one loop per format, so that the branch is taken once per group
    if code == Q4_0:
        for b in range(nb):
            simd.block_q4_0(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 32, dx, xsf, b, acc)
    elif code == Q4_1:
        for b in range(nb):
            simd.block_q4_1(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 32, dx, xsf, b, acc)
    elif code == Q5_0:
        for b in range(nb):
            simd.block_q5_0(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 32, dx, xsf, b, acc)
    elif code == Q5_1:
        for b in range(nb):
            simd.block_q5_1(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 32, dx, xsf, b, acc)
    elif code == Q8_0:
        for b in range(nb):
            simd.block_q8_0(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 32, dx, xsf, b, acc)
    elif code == Q2_K:
        for b in range(nb):
            simd.block_q2_k(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 256, dx, xsf, b * 8, acc)
    elif code == Q3_K:
        for b in range(nb):
            simd.block_q3_k(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 256, dx, xsf, b * 8, acc)
    elif code == Q4_K:
        for b in range(nb):
            simd.block_q4_k(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 256, dx, xsf, b * 8, acc)
    elif code == Q5_K:
        for b in range(nb):
            simd.block_q5_k(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 256, dx, xsf, b * 8, acc)
    elif code == Q6_K:
        for b in range(nb):
            simd.block_q6_k(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * 256, dx, xsf, b * 8, acc)


@njit(cache=True, nogil=True)
def group_simd_tile(q, s, code, g, xq, xq2, dx, xsum, i0, acc):
    """acc (TILE, ROWS) = W[g*ROWS : (g+1)*ROWS] @ x̂_i for the TILE tokens i0 <= i < i0 + TILE (prefill).

    xq (t, n/32, 32), dx (t, n/32), xsum (t, n/32, 2) as from quantize_x; xq2 (t, n/32, 64): every token's
    xq with each byte pair written twice (`double_pairs`), which the pair kernels read. The tile kernels decode
    each block's bytes once for all TILE tokens; each token's result is group_simd's for that token, bit for
    bit.
    """
    acc[:] = 0
    nb = q.shape[1]
    qstep = q.shape[2] * q.shape[3] * q.shape[4] * q.shape[5]  # bytes per block of the group
    sstep = s.shape[2] * ROWS
    qf = q.reshape(-1)
    sf = s.reshape(-1)
    xf = xq.reshape(-1)
    xf2 = xq2.reshape(-1)
    dxf = dx.reshape(-1)
    xsf = xsum.reshape(-1)
    af = acc.reshape(-1)
    q0 = g * nb * qstep
    s0 = g * nb * sstep
    nx = dx.shape[1]  # 32-blocks of x per token
    n = nx * 32  # values per token
    x0 = i0 * n
    b0 = i0 * nx  # token i0's first 32-block in dx, xsum
    if code == Q4_0:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q4_0_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 32, n, dxf, xsf, b0 + b, nx, af)
    elif code == Q4_1:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q4_1_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 32, n, dxf, xsf, b0 + b, nx, af)
    elif code == Q5_0:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q5_0_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 32, n, dxf, xsf, b0 + b, nx, af)
    elif code == Q5_1:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q5_1_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 32, n, dxf, xsf, b0 + b, nx, af)
    elif code == Q8_0:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q8_0_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 32, n, dxf, xsf, b0 + b, nx, af)
    elif code == Q2_K:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q2_k_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 256, n, dxf, xsf, b0 + b * 8, nx, af)
    elif code == Q3_K:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q3_k_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 256, n, dxf, xsf, b0 + b * 8, nx, af)
    elif code == Q4_K:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q4_k_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 256, n, dxf, xsf, b0 + b * 8, nx, af)
    elif code == Q5_K:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q5_k_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 256, n, dxf, xsf, b0 + b * 8, nx, af)
    elif code == Q6_K:
        for b in range(nb):
            so = s0 + b * sstep
            simd.block_q6_k_tile(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * 256, n, dxf, xsf, b0 + b * 8, nx, af)


# ---- drivers --------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True, nogil=True)
def matvec(q, s, code, x, out):
    """W (d, n) @ x̂ (n,) -> out (d,): x quantized per 32 to int8, one row group per parallel iteration."""
    xq, dx, xsum = quantize_x(x)
    d = out.shape[0]
    for g in prange(q.shape[0]):
        acc = np.empty(ROWS, dtype=np.float32)
        group_simd(q, s, code, g, xq, dx, xsum, acc)
        for r in range(min(ROWS, d - g * ROWS)):
            out[g * ROWS + r] = acc[r]


@njit(cache=True, nogil=True)
def matvec_serial(q, s, code, x, out):
    """`matvec` on the calling thread alone: for weights too small to repay a parallel launch."""
    xq, dx, xsum = quantize_x(x)
    d = out.shape[0]
    acc = np.empty(ROWS, dtype=np.float32)
    for g in range(q.shape[0]):
        group_simd(q, s, code, g, xq, dx, xsum, acc)
        for r in range(min(ROWS, d - g * ROWS)):
            out[g * ROWS + r] = acc[r]


@njit(parallel=True, cache=True, nogil=True)
def matvec_reference(q, s, code, x, out):
    """`matvec` with the plain-loop kernels (group_*): the same arithmetic, for checking simd.py."""
    xq, dx, xsum = quantize_x(x)
    d = out.shape[0]
    for g in prange(q.shape[0]):
        acc = np.empty(ROWS, dtype=np.float32)
        group_reference(q, s, code, g, xq, dx, xsum, acc)
        for r in range(min(ROWS, d - g * ROWS)):
            out[g * ROWS + r] = acc[r]


@njit(parallel=True, cache=True, nogil=True)
def matmul(q, s, code, xs, out):
    """xs (t, n) @ W.T -> out (t, d) with every token's x quantized as in `matvec` (prefill).

    A parallel item is one row group for up to PER_ITEM tokens: its weights come from memory once and from
    cache for the other tokens. They run TILE tokens at a time through group_simd_tile, which decodes the
    weight bytes once per tile, and the last t % TILE one by one through group_simd; either way each token's
    row of out equals `matvec` of it, bit for bit.
    """
    t, n = xs.shape
    nb = n // 32
    xq = np.empty((t, nb, 32), dtype=np.int8)
    dx = np.empty((t, nb), dtype=np.float32)
    xsum = np.empty((t, nb, 2), dtype=np.int32)
    xq2 = np.empty((t, nb, 64), dtype=np.int8)
    for i in prange(t):
        quantize_into(xs[i], xq[i], dx[i], xsum[i])
        double_pairs(xq[i], xq2[i])
    d = out.shape[1]
    n_tok = (t + PER_ITEM - 1) // PER_ITEM
    for item in prange(q.shape[0] * n_tok):
        g = item // n_tok
        t0 = (item % n_tok) * PER_ITEM
        t1 = min(t, t0 + PER_ITEM)
        rows = min(ROWS, d - g * ROWS)
        acc = np.empty((TILE, ROWS), dtype=np.float32)
        t_tiled = t0 + (t1 - t0) // TILE * TILE
        for i in range(t0, t_tiled, TILE):
            group_simd_tile(q, s, code, g, xq, xq2, dx, xsum, i, acc)
            for k in range(TILE):
                for r in range(rows):
                    out[i + k, g * ROWS + r] = acc[k, r]
        for i in range(t_tiled, t1):
            group_simd(q, s, code, g, xq[i], dx[i], xsum[i], acc[0])
            for r in range(rows):
                out[i, g * ROWS + r] = acc[0, r]


@njit(parallel=True, cache=True, nogil=True)
def matvec_many(qs, ss, code, x, outs):
    """W_i @ x̂ -> outs[i] for several weights of one format and width, in one parallel launch.

    qs, ss, outs: tuples of the weights' packed arrays and their outputs.
    """
    xq, dx, xsum = quantize_x(x)
    k = len(qs)
    starts = np.zeros(k + 1, dtype=np.int64)
    for i in range(k):
        starts[i + 1] = starts[i] + qs[i].shape[0]
    for item in prange(starts[k]):
        i = 0
        while item >= starts[i + 1]:
            i += 1
        g = item - starts[i]
        acc = np.empty(ROWS, dtype=np.float32)
        group_simd(qs[i], ss[i], code, g, xq, dx, xsum, acc)
        out = outs[i]
        for r in range(min(ROWS, out.shape[0] - g * ROWS)):
            out[g * ROWS + r] = acc[r]


# ---- packing and unpacking ------------------------------------------------------------------------------


@njit(inline="always", cache=True, nogil=True)
def _even_bits(v):
    """Bits 0, 2, ..., 14 of v packed into bits 0-7."""
    v &= 0x5555
    v = (v | (v >> 1)) & 0x3333
    v = (v | (v >> 2)) & 0x0F0F
    return (v | (v >> 4)) & 0x00FF


@njit(inline="always", cache=True, nogil=True)
def _spread_bits(v):
    """Bits 0-7 of v spread to bits 0, 2, ..., 14 (the inverse of _even_bits)."""
    v &= 0x00FF
    v = (v | (v << 4)) & 0x0F0F
    v = (v | (v << 2)) & 0x3333
    return (v | (v << 1)) & 0x5555


@njit(inline="always", cache=True, nogil=True)
def qh_order(h):
    """Q5_0's and Q5_1's 16 high bits reordered for the kernels: bit 2t -> bit t, bit 2t + 1 -> bit 8 + t."""
    return np.uint16(_even_bits(h) | (_even_bits(h >> 1) << 8))


@njit(inline="always", cache=True, nogil=True)
def qh_unorder(h):
    """The inverse of qh_order."""
    return np.uint16(_spread_bits(h) | (_spread_bits(h >> 8) << 1))


@njit(parallel=True, cache=True, nogil=True)
def pack(raw, code, block_bytes, copies, halves, q, s):
    """raw uint8 (d, row_bytes), the file's rows -> q, s (zero-initialised by the caller, in `layout(code)`).

    Every copied field starts at an even offset of an even-sized block, so q's byte pairs are the file's
    16-bit words: the copy moves 16-bit words, read in file order, rows becoming innermost (W/2 words of a
    row side by side).
    """
    d = raw.shape[0]
    nb = q.shape[1]
    lanes, hw = q.shape[4], q.shape[5] // 2  # rows per chunk, 16-bit words of a row side by side
    words = q.shape[3] * hw  # 16-bit words per block row
    w = block_bytes // 2
    raw16 = raw.view(np.uint16)
    q16 = q.view(np.uint16).reshape(-1)
    for g in prange(q.shape[0]):
        for r in range(min(ROWS, d - g * ROWS)):
            src_row = raw16[g * ROWS + r]
            c, lane = r // lanes, r % lanes
            for b in range(nb):
                base = ((g * nb + b) * (ROWS // lanes) + c) * words * lanes + lane * hw
                for cp in range(copies.shape[0]):
                    src = b * w + copies[cp, 0] // 2
                    k0 = copies[cp, 1] // 2
                    for k in range(copies[cp, 2] // 2):
                        kk = k0 + k
                        q16[base + (kk // hw) * lanes * hw + kk % hw] = src_row[src + k]
                for h in range(halves.shape[0]):
                    s[g, b, h, r] = src_row[b * w + halves[h] // 2]
                if code == Q5_0 or code == Q5_1:  # the last two fields are qh
                    nh = halves.shape[0]
                    s[g, b, nh - 2, r] = qh_order(np.int64(s[g, b, nh - 2, r]))
                    s[g, b, nh - 1, r] = qh_order(np.int64(s[g, b, nh - 1, r]))
                elif code == Q3_K:
                    row = raw[g * ROWS + r]
                    for j in range(16):
                        set_qbyte(q, g, b, 96 + j, r, np.uint8(q3_k_scale(row, b * block_bytes, j) & 255))
                elif code == Q4_K or code == Q5_K:
                    row = raw[g * ROWS + r]
                    for j in range(8):
                        sc, m = k4_scale_min(row, b * block_bytes, j)
                        set_qbyte(q, g, b, 128 + j, r, sc)
                        set_qbyte(q, g, b, 136 + j, r, m)


@njit(inline="always", cache=True, nogil=True)
def unpack_row(q, s, code, block_bytes, copies, halves, row, out):
    """Row `row` of the packed weight back into its file bytes: out uint8 (row_bytes,)."""
    g = row // ROWS
    r = row % ROWS
    for b in range(q.shape[1]):
        o = b * block_bytes
        for c in range(copies.shape[0]):
            for k in range(copies[c, 2]):
                kk = copies[c, 1] + k
                out[o + copies[c, 0] + k] = qbyte(q, g, b, kk, r)
        for h in range(halves.shape[0]):
            v = np.int64(s[g, b, h, r])
            if (code == Q5_0 or code == Q5_1) and h >= halves.shape[0] - 2:
                v = np.int64(qh_unorder(v))
            out[o + halves[h]] = np.uint8(v & 255)
            out[o + halves[h] + 1] = np.uint8(v >> 8)
        if code == Q3_K:  # re-encode the 6-bit scales (the inverse of q3_k_scale)
            for j in range(4):  # scales j, 4 + j, 8 + j, 12 + j, back to 0..63
                s0 = np.int32(i8(qbyte(q, g, b, 96 + j, r))) + 32
                s1 = np.int32(i8(qbyte(q, g, b, 100 + j, r))) + 32
                s2 = np.int32(i8(qbyte(q, g, b, 104 + j, r))) + 32
                s3 = np.int32(i8(qbyte(q, g, b, 108 + j, r))) + 32
                out[o + 96 + j] = np.uint8((s0 & 15) | ((s2 & 15) << 4))
                out[o + 100 + j] = np.uint8((s1 & 15) | ((s3 & 15) << 4))
                out[o + 104 + j] = np.uint8((s0 >> 4) | ((s1 >> 4) << 2) | ((s2 >> 4) << 4) | ((s3 >> 4) << 6))
        if code == Q4_K or code == Q5_K:  # re-encode the 6-bit scales and mins (the inverse of k4_scale_min)
            for j in range(4):
                sc_lo = qbyte(q, g, b, 128 + j, r)
                sc_hi = qbyte(q, g, b, 132 + j, r)
                m_lo = qbyte(q, g, b, 136 + j, r)
                m_hi = qbyte(q, g, b, 140 + j, r)
                out[o + 4 + j] = sc_lo | ((sc_hi >> 4) << 6)
                out[o + 8 + j] = m_lo | ((m_hi >> 4) << 6)
                out[o + 12 + j] = (sc_hi & 15) | ((m_hi & 15) << 4)


@njit(cache=True, nogil=True)
def decode_row(q, s, code, block_bytes, copies, halves, f16, row, buf, out):
    """W[row] -> out (n,) float32, through its file bytes (buf, row_bytes) and blocks.py's decoders."""
    unpack_row(q, s, code, block_bytes, copies, halves, row, buf)
    _deq_row(buf, code, f16, out)


@njit(parallel=True, cache=True, nogil=True)
def dequantize_rows(q, s, code, block_bytes, copies, halves, f16, r0, out):
    """W[r0 : r0 + k] (k, n) -> out (k, n) float32."""
    row_bytes = q.shape[1] * block_bytes
    k = out.shape[0]
    n_chunks = min(k, 64)
    for c in prange(n_chunks):
        buf = np.empty(row_bytes, dtype=np.uint8)
        for i in range(c * k // n_chunks, (c + 1) * k // n_chunks):
            decode_row(q, s, code, block_bytes, copies, halves, f16, r0 + i, buf, out[i])


@njit(cache=True, nogil=True)
def dequantize_row(q, s, code, block_bytes, copies, halves, f16, r, out):
    """W[r] -> out (n,) float32: one row, serial (embedding lookups)."""
    buf = np.empty(q.shape[1] * block_bytes, dtype=np.uint8)
    decode_row(q, s, code, block_bytes, copies, halves, f16, r, buf, out)
