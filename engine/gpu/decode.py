"""Vectorised decoders for every weight type the engine runs, written against an array module `xp`.

One decoder per ggml type, named after it: `decode_<type>(xp, b)` takes blocks b uint8 (n, block_bytes) in the
file's layout and returns their values, float32 (n, block_size), as ggml's dequantize_row_<type> does. The
same code runs on CuPy arrays on the GPU and on NumPy arrays in the tests, where `gguf.quants.dequantize` is
the oracle. Layouts follow ggml-common.h (and gguf-py's quants.py, which these mirror operation by operation).
Half-precision fields are assembled from their two bytes, so no decoder needs a contiguous view of a block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

QK_K = 256  # values in a K-quant super-block

Array = Any  # an xp.ndarray


def _u16(xp: ModuleType, b: Array) -> Array:
    """Little-endian 16-bit words: b uint8 (n, 2k) -> uint16 (n, k)."""
    lo, hi = b[:, 0::2].astype(xp.uint16), b[:, 1::2].astype(xp.uint16)
    return lo | (hi << 8)  # (n, k)


def _half(xp: ModuleType, b: Array) -> Array:
    """Halves: b uint8 (n, 2k) -> float32 (n, k)."""
    return xp.ascontiguousarray(_u16(xp, b)).view(xp.float16).astype(xp.float32)


def _u32(xp: ModuleType, b: Array) -> Array:
    """One little-endian 32-bit word per block: b uint8 (n, 4) -> uint32 (n, 1)."""
    w = b.astype(xp.uint32)
    return (w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24))[:, None]


def _i8(xp: ModuleType, b: Array) -> Array:
    """Bytes read as signed: uint8 -> int16 of the same shape."""
    return (b.astype(xp.int16) ^ 128) - 128


def _nibbles(xp: ModuleType, qs: Array) -> Array:
    """qs uint8 (n, 16) -> (n, 32): the 16 low nibbles, then the 16 high ones."""
    return xp.concatenate([qs & 15, qs >> 4], axis=1)


def _bits(xp: ModuleType, qh: Array, n_bits: int) -> Array:
    """qh uint32 (n, 1) -> uint8 (n, n_bits): bit j of each word."""
    return ((qh >> _constant(xp, "uint32", tuple(range(n_bits)))[None, :]) & 1).astype(xp.uint8)


def _shifts(xp: ModuleType, *values: int) -> Array:
    """A shift vector broadcast along the second-to-last axis: (1, 1, len(values), 1) uint8."""
    return _constant(xp, "uint8", values).reshape(1, 1, len(values), 1)


@functools.cache
def _constant(xp: ModuleType, dtype: str, values: tuple[int, ...]) -> Array:
    """A small constant vector, made (and, under CuPy, copied to the device) once; never written to."""
    return xp.asarray(values, dtype=dtype)


# ---- floats -----------------------------------------------------------------------------------------------


def decode_f32(xp: ModuleType, b: Array) -> Array:
    # b (n, 4) -> (n, 1)
    return xp.ascontiguousarray(b).view(xp.float32)


def decode_f16(xp: ModuleType, b: Array) -> Array:
    # b (n, 2) -> (n, 1)
    return _half(xp, b)


def decode_bf16(xp: ModuleType, b: Array) -> Array:
    # b (n, 2) -> (n, 1): a bfloat16 is the top half of a float32
    return xp.ascontiguousarray(_u16(xp, b).astype(xp.uint32) << 16).view(xp.float32)


# ---- 32-value blocks --------------------------------------------------------------------------------------


def decode_q4_0(xp: ModuleType, b: Array) -> Array:
    # [d f16][qs 16]: d · (q - 8)
    d = _half(xp, b[:, 0:2])  # (n, 1)
    q = _nibbles(xp, b[:, 2:18]).astype(xp.int8) - 8  # (n, 32)
    return d * q.astype(xp.float32)


def decode_q4_1(xp: ModuleType, b: Array) -> Array:
    # [d f16][m f16][qs 16]: d · q + m
    d, m = _half(xp, b[:, 0:2]), _half(xp, b[:, 2:4])  # (n, 1) each
    return d * _nibbles(xp, b[:, 4:20]).astype(xp.float32) + m


def decode_q5_0(xp: ModuleType, b: Array) -> Array:
    # [d f16][qh u32][qs 16]: d · (q - 16), bit 4 of value j from bit j of qh
    d = _half(xp, b[:, 0:2])  # (n, 1)
    q = _nibbles(xp, b[:, 6:22]) | (_bits(xp, _u32(xp, b[:, 2:6]), 32) << 4)  # (n, 32)
    return d * (q.astype(xp.int8) - 16).astype(xp.float32)


def decode_q5_1(xp: ModuleType, b: Array) -> Array:
    # [d f16][m f16][qh u32][qs 16]: d · q + m
    d, m = _half(xp, b[:, 0:2]), _half(xp, b[:, 2:4])  # (n, 1) each
    q = _nibbles(xp, b[:, 8:24]) | (_bits(xp, _u32(xp, b[:, 4:8]), 32) << 4)  # (n, 32)
    return d * q.astype(xp.float32) + m


def decode_q8_0(xp: ModuleType, b: Array) -> Array:
    # [d f16][qs int8 32]: d · q
    return _i8(xp, b[:, 2:34]).astype(xp.float32) * _half(xp, b[:, 0:2])


# ---- 256-value K-quant super-blocks -----------------------------------------------------------------------


def decode_q2_k(xp: ModuleType, b: Array) -> Array:
    # [scales 16: 4-bit scale | 4-bit min << 4][qs 64: 2 bits each][d f16][dmin f16]
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _half(xp, b[:, 80:82]), _half(xp, b[:, 82:84])  # (n, 1) each
    dl = (d * (scales & 15).astype(xp.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(xp.float32)).reshape(n, 16, 1)
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> _shifts(xp, 0, 2, 4, 6)) & 3  # (n, 2, 4, 32)
    q = q.reshape(n, 16, 16).astype(xp.float32)
    return (dl * q - ml).reshape(n, QK_K)


def decode_q3_k(xp: ModuleType, b: Array) -> Array:
    # [hmask 32][qs 64: 2 low bits][scales 12: 6-bit, packed][d f16]
    n = b.shape[0]
    d = _half(xp, b[:, 108:110])  # (n, 1)
    lo = (b[:, 96:104].reshape(n, 1, 8) >> _shifts(xp, 0, 4)[0]).reshape(n, 16)
    hi = (b[:, 104:108].reshape(n, 1, 4) >> _shifts(xp, 0, 2, 4, 6)[0]).reshape(n, 16)
    scales = (lo & 15) | ((hi & 3) << 4)  # (n, 16) in 0..63
    dl = (d * (scales.astype(xp.int8) - 32).astype(xp.float32)).reshape(n, 16, 1)
    ql = (b[:, 32:96].reshape(n, 2, 1, 32) >> _shifts(xp, 0, 2, 4, 6)).reshape(n, 16, 16) & 3
    qh = (b[:, 0:32].reshape(n, 1, 1, 32) >> _shifts(xp, *range(8))).reshape(n, 16, 16) & 1
    q = ql.astype(xp.int8) - ((qh ^ 1) << 2).astype(xp.int8)  # a clear hmask bit subtracts 4
    return (dl * q.astype(xp.float32)).reshape(n, QK_K)


def _scale_min_k4(xp: ModuleType, s: Array) -> tuple[Array, Array]:
    """The 6-bit scales and mins of Q4_K / Q5_K: s uint8 (n, 12) -> two uint8 (n, 8)."""
    n = s.shape[0]
    s = s.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # (n, 4) each
    sc = xp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = xp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_q4_k(xp: ModuleType, b: Array) -> Array:
    # [d f16][dmin f16][scales 12][qs 128]: 8 sub-blocks of 32, each d·sc·q - dmin·m
    n = b.shape[0]
    d, dmin = _half(xp, b[:, 0:2]), _half(xp, b[:, 2:4])  # (n, 1) each
    sc, mn = _scale_min_k4(xp, b[:, 4:16])
    dl = (d * sc.astype(xp.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(xp.float32)).reshape(n, 8, 1)
    q = (b[:, 16:144].reshape(n, 4, 1, 32) >> _shifts(xp, 0, 4)) & 15  # (n, 4, 2, 32)
    return (dl * q.reshape(n, 8, 32).astype(xp.float32) - ml).reshape(n, QK_K)


def decode_q5_k(xp: ModuleType, b: Array) -> Array:
    # [d f16][dmin f16][scales 12][qh 32][qs 128]: as Q4_K with a fifth bit from qh
    n = b.shape[0]
    d, dmin = _half(xp, b[:, 0:2]), _half(xp, b[:, 2:4])  # (n, 1) each
    sc, mn = _scale_min_k4(xp, b[:, 4:16])
    dl = (d * sc.astype(xp.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(xp.float32)).reshape(n, 8, 1)
    ql = ((b[:, 48:176].reshape(n, 4, 1, 32) >> _shifts(xp, 0, 4)) & 15).reshape(n, 8, 32)
    qh = ((b[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(xp, *range(8))) & 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).astype(xp.float32)
    return (dl * q - ml).reshape(n, QK_K)


def decode_q6_k(xp: ModuleType, b: Array) -> Array:
    # [ql 128: low 4 bits][qh 64: high 2 bits][scales int8 16][d f16]: d · sc · (q - 32)
    n = b.shape[0]
    d = _half(xp, b[:, 208:210])  # (n, 1)
    dl = (d * _i8(xp, b[:, 192:208]).astype(xp.float32)).reshape(n, 16, 1)
    ql = ((b[:, 0:128].reshape(n, 2, 1, 64) >> _shifts(xp, 0, 4)) & 15).reshape(n, 8, 32)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(xp, 0, 2, 4, 6)) & 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).astype(xp.int8) - 32
    return (dl * q.reshape(n, 16, 16).astype(xp.float32)).reshape(n, QK_K)


DECODERS: dict[T, Callable[[ModuleType, Array], Array]] = {
    T.F32: decode_f32,
    T.F16: decode_f16,
    T.BF16: decode_bf16,
    T.Q4_0: decode_q4_0,
    T.Q4_1: decode_q4_1,
    T.Q5_0: decode_q5_0,
    T.Q5_1: decode_q5_1,
    T.Q8_0: decode_q8_0,
    T.Q2_K: decode_q2_k,
    T.Q3_K: decode_q3_k,
    T.Q4_K: decode_q4_k,
    T.Q5_K: decode_q5_k,
    T.Q6_K: decode_q6_k,
}


def decode_rows(xp: ModuleType, ggml_type: T, raw: Array, cols: int) -> Array:
    """Rows of a weight in the file's encoding, raw uint8 (r, row_bytes) -> float32 (r, cols)."""
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    r = raw.shape[0]
    blocks = raw.reshape(r * (cols // block), block_bytes)  # (r·nb, block_bytes)
    return DECODERS[ggml_type](xp, blocks).reshape(r, cols)
