"""Numba-parallel drivers over quantized weight matrices.

A weight matrix W (d, n) is stored as its GGUF bytes: `w` uint8 (d, row_bytes), each row its blocks back to
back. `code` selects the format (the `Q*` constants below, equal to ggml's type ids). The format branch sits
outside the block loop, so it costs one comparison chain per row.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from .blocks import (
    deq_q2_k,
    deq_q3_k,
    deq_q4_0,
    deq_q4_1,
    deq_q4_k,
    deq_q5_0,
    deq_q5_1,
    deq_q5_k,
    deq_q6_k,
    deq_q8_0,
    dot_q4_0,
    dot_q4_1,
    dot_q4_k,
    dot_q5_0,
    dot_q5_1,
    dot_q5_k,
    dot_q6_k,
    dot_q8_0,
)

# ggml type ids
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (int(t) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = (int(t) for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K))

# (values per block, bytes per block), from gguf
BLOCK = {code: GGML_QUANT_SIZES[T(code)] for code in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)}


@njit(inline="always", cache=True, nogil=True)
def _deq_row(row, code, f16, out):
    """Decode one whole row into out (n,)."""
    if code == Q4_0:
        for b in range(out.shape[0] // 32):
            deq_q4_0(row, b * 18, f16, out, b * 32)
    elif code == Q4_1:
        for b in range(out.shape[0] // 32):
            deq_q4_1(row, b * 20, f16, out, b * 32)
    elif code == Q5_0:
        for b in range(out.shape[0] // 32):
            deq_q5_0(row, b * 22, f16, out, b * 32)
    elif code == Q5_1:
        for b in range(out.shape[0] // 32):
            deq_q5_1(row, b * 24, f16, out, b * 32)
    elif code == Q8_0:
        for b in range(out.shape[0] // 32):
            deq_q8_0(row, b * 34, f16, out, b * 32)
    elif code == Q2_K:
        for b in range(out.shape[0] // 256):
            deq_q2_k(row, b * 84, f16, out, b * 256)
    elif code == Q3_K:
        for b in range(out.shape[0] // 256):
            deq_q3_k(row, b * 110, f16, out, b * 256)
    elif code == Q4_K:
        for b in range(out.shape[0] // 256):
            deq_q4_k(row, b * 144, f16, out, b * 256)
    elif code == Q5_K:
        for b in range(out.shape[0] // 256):
            deq_q5_k(row, b * 176, f16, out, b * 256)
    elif code == Q6_K:
        for b in range(out.shape[0] // 256):
            deq_q6_k(row, b * 210, f16, out, b * 256)


@njit(inline="always", cache=True, nogil=True)
def _dot_row(row, code, f16, x, buf):
    """row · x for one row; buf (256,) is scratch for formats without a fused dot."""
    n = x.shape[0]
    acc = np.float32(0.0)
    if code == Q4_0:
        for b in range(n // 32):
            acc += dot_q4_0(row, b * 18, f16, x, b * 32)
    elif code == Q4_1:
        for b in range(n // 32):
            acc += dot_q4_1(row, b * 20, f16, x, b * 32)
    elif code == Q5_0:
        for b in range(n // 32):
            acc += dot_q5_0(row, b * 22, f16, x, b * 32)
    elif code == Q5_1:
        for b in range(n // 32):
            acc += dot_q5_1(row, b * 24, f16, x, b * 32)
    elif code == Q8_0:
        for b in range(n // 32):
            acc += dot_q8_0(row, b * 34, f16, x, b * 32)
    elif code == Q4_K:
        for b in range(n // 256):
            acc += dot_q4_k(row, b * 144, f16, x, b * 256)
    elif code == Q5_K:
        for b in range(n // 256):
            acc += dot_q5_k(row, b * 176, f16, x, b * 256)
    elif code == Q6_K:
        for b in range(n // 256):
            acc += dot_q6_k(row, b * 210, f16, x, b * 256)
    else:  # Q2_K, Q3_K: decode a super-block into scratch, then dot
        for b in range(n // 256):
            if code == Q2_K:
                deq_q2_k(row, b * 84, f16, buf, 0)
            else:
                deq_q3_k(row, b * 110, f16, buf, 0)
            for k in range(256):
                acc += buf[k] * x[b * 256 + k]
    return acc


@njit(parallel=True, cache=True, nogil=True)
def matvec(w, code, f16, x, out):
    """W (d, n) @ x (n,) -> out (d,)."""
    d = w.shape[0]
    n_chunks = min(d, 64)
    for c in prange(n_chunks):
        buf = np.empty(256, dtype=np.float32)
        for r in range(c * d // n_chunks, (c + 1) * d // n_chunks):
            out[r] = _dot_row(w[r], code, f16, x, buf)


@njit(parallel=True, cache=True, nogil=True)
def matvec_rows(w, code, f16, x, rows, out):
    """W[rows] (k, n) @ x (n,) -> out (k,): only the listed rows (e.g. a vocabulary subset)."""
    k = rows.shape[0]
    for i in prange(k):
        buf = np.empty(256, dtype=np.float32)
        out[i] = _dot_row(w[rows[i]], code, f16, x, buf)


@njit(parallel=True, cache=True, nogil=True)
def dequantize_rows(w, code, f16, r0, out):
    """W[r0 : r0 + k] (k, n) -> out (k, n) float32."""
    for i in prange(out.shape[0]):
        _deq_row(w[r0 + i], code, f16, out[i])


@njit(cache=True, nogil=True)
def dequantize_row(w, code, f16, r, out):
    """W[r] -> out (n,): one row, serial (embedding lookups)."""
    _deq_row(w[r], code, f16, out)
