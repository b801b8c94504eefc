"""Per-format block decoders and fused block dot products, straight from the GGUF byte layout.

One decoder per ggml type, named after it. Each reads one block of a weight row stored as raw bytes
(`row`: uint8, the row's blocks back to back) starting at byte offset `o`:

- `deq_<type>(row, o, f16, out, p)` writes the block's values to `out[p : p + block_size]`.
- `dot_<type>(row, o, f16, x, p)` returns `sum(block * x[p : p + block_size])` without materialising the block.

`f16` is the 65536-entry table that maps IEEE half bit patterns to float32 (`F16_TABLE`): a table lookup is
cheaper than decoding the bits in Numba, and every format stores its scales as halves.
Layouts follow ggml-common.h; `gguf.quants.dequantize` is the oracle in the tests.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

_INL = {"inline": "always", "cache": True, "nogil": True, "fastmath": False}


@njit(**_INL)
def half(row, o, f16):
    """The float32 value of the little-endian half at row[o:o+2]."""
    return f16[np.int32(row[o]) | (np.int32(row[o + 1]) << 8)]


@njit(**_INL)
def u32(row, o):
    return (
        np.uint32(row[o]) | (np.uint32(row[o + 1]) << 8) | (np.uint32(row[o + 2]) << 16) | (np.uint32(row[o + 3]) << 24)
    )


@njit(**_INL)
def i8(b):
    """Reinterpret an unsigned byte as signed."""
    return (np.int32(b) ^ 128) - 128


# ---- 32-value blocks ------------------------------------------------------------------------------------


@njit(**_INL)
def deq_q4_0(row, o, f16, out, p):
    d = half(row, o, f16)
    for j in range(16):
        q = np.int32(row[o + 2 + j])
        out[p + j] = d * ((q & 15) - 8)
        out[p + j + 16] = d * ((q >> 4) - 8)


@njit(**_INL)
def dot_q4_0(row, o, f16, x, p):
    s = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 2 + j])
        s += ((q & 15) - 8) * x[p + j] + ((q >> 4) - 8) * x[p + j + 16]
    return half(row, o, f16) * s


@njit(**_INL)
def deq_q4_1(row, o, f16, out, p):
    d = half(row, o, f16)
    m = half(row, o + 2, f16)
    for j in range(16):
        q = np.int32(row[o + 4 + j])
        out[p + j] = d * (q & 15) + m
        out[p + j + 16] = d * (q >> 4) + m


@njit(**_INL)
def dot_q4_1(row, o, f16, x, p):
    s = np.float32(0.0)
    sx = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 4 + j])
        a = x[p + j]
        b = x[p + j + 16]
        s += (q & 15) * a + (q >> 4) * b
        sx += a + b
    return half(row, o, f16) * s + half(row, o + 2, f16) * sx


@njit(**_INL)
def deq_q5_0(row, o, f16, out, p):
    d = half(row, o, f16)
    qh = u32(row, o + 2)
    for j in range(16):
        q = np.int32(row[o + 6 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        out[p + j] = d * (((q & 15) | h0) - 16)
        out[p + j + 16] = d * (((q >> 4) | h1) - 16)


@njit(**_INL)
def dot_q5_0(row, o, f16, x, p):
    qh = u32(row, o + 2)
    s = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 6 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        s += (((q & 15) | h0) - 16) * x[p + j] + (((q >> 4) | h1) - 16) * x[p + j + 16]
    return half(row, o, f16) * s


@njit(**_INL)
def deq_q5_1(row, o, f16, out, p):
    d = half(row, o, f16)
    m = half(row, o + 2, f16)
    qh = u32(row, o + 4)
    for j in range(16):
        q = np.int32(row[o + 8 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        out[p + j] = d * ((q & 15) | h0) + m
        out[p + j + 16] = d * ((q >> 4) | h1) + m


@njit(**_INL)
def dot_q5_1(row, o, f16, x, p):
    qh = u32(row, o + 4)
    s = np.float32(0.0)
    sx = np.float32(0.0)
    for j in range(16):
        q = np.int32(row[o + 8 + j])
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        a = x[p + j]
        b = x[p + j + 16]
        s += ((q & 15) | h0) * a + ((q >> 4) | h1) * b
        sx += a + b
    return half(row, o, f16) * s + half(row, o + 2, f16) * sx


@njit(**_INL)
def deq_q8_0(row, o, f16, out, p):
    d = half(row, o, f16)
    for j in range(32):
        out[p + j] = d * i8(row[o + 2 + j])


@njit(**_INL)
def dot_q8_0(row, o, f16, x, p):
    s = np.float32(0.0)
    for j in range(32):
        s += i8(row[o + 2 + j]) * x[p + j]
    return half(row, o, f16) * s


# ---- 256-value super-blocks (k-quants) ------------------------------------------------------------------


@njit(**_INL)
def deq_q2_k(row, o, f16, out, p):
    # scales[16] @0, qs[64] @16, d @80, dmin @82
    d = half(row, o + 80, f16)
    dmin = half(row, o + 82, f16)
    for n in range(2):
        for j in range(4):
            shift = 2 * j
            for half_ in range(2):
                sc = np.int32(row[o + n * 8 + j * 2 + half_])
                dl = d * (sc & 15)
                ml = dmin * (sc >> 4)
                base = p + n * 128 + j * 32 + half_ * 16
                for ll in range(16):
                    q = (np.int32(row[o + 16 + n * 32 + half_ * 16 + ll]) >> shift) & 3
                    out[base + ll] = dl * q - ml


@njit(**_INL)
def q3_k_scale(row, o, j):
    """The j-th signed 6-bit scale of a Q3_K block (12 packed bytes at o + 96)."""
    low = (np.int32(row[o + 96 + (j % 8)]) >> (4 * (j // 8))) & 15
    high = (np.int32(row[o + 96 + 8 + (j % 4)]) >> (2 * (j // 4))) & 3
    return (low | (high << 4)) - 32


@njit(**_INL)
def deq_q3_k(row, o, f16, out, p):
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


@njit(**_INL)
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


@njit(**_INL)
def deq_q4_k(row, o, f16, out, p):
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


@njit(**_INL)
def dot_q4_k(row, o, f16, x, p):
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


@njit(**_INL)
def deq_q5_k(row, o, f16, out, p):
    # d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48
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
            q = np.int32(row[o + 48 + j * 32 + ll])
            h = np.int32(row[o + 16 + ll])
            out[p + j * 64 + ll] = d1 * ((q & 15) + (((h >> (2 * j)) & 1) << 4)) - mm1
            out[p + j * 64 + 32 + ll] = d2 * ((q >> 4) + (((h >> (2 * j + 1)) & 1) << 4)) - mm2


@njit(**_INL)
def dot_q5_k(row, o, f16, x, p):
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
            q = np.int32(row[o + 48 + j * 32 + ll])
            h = np.int32(row[o + 16 + ll])
            a = x[b + ll]
            c = x[b + 32 + ll]
            s1 += ((q & 15) + (((h >> (2 * j)) & 1) << 4)) * a
            s2 += ((q >> 4) + (((h >> (2 * j + 1)) & 1) << 4)) * c
            x1 += a
            x2 += c
        total += d * (sc1 * s1 + sc2 * s2) - dmin * (m1 * x1 + m2 * x2)
    return total


@njit(**_INL)
def deq_q6_k(row, o, f16, out, p):
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


@njit(**_INL)
def dot_q6_k(row, o, f16, x, p):
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
