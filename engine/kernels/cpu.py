"""Numba-parallel drivers over quantized weight matrices in their file layout: the float32 reference path.

A weight matrix W (d, n) is stored as its GGUF bytes: `w` uint8 (d, row_bytes), each row its blocks back to
back. `fmt` is the format's tag (engine.formats.dispatch.tag). The per-format row functions come from each format's
reference `deq` and `dot` (engine/formats), and each driver is compiled for the format it is called
with (formats.dispatch.by_format).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..formats import QUANTIZED, Format
from ..formats.dispatch import by_format
from ..formats.spec import Kernel


def _deq_row_of(fmt: Format) -> Kernel:
    """deq_row(row, f16, out): one whole row of `fmt` dequantized into out (n,)."""
    deq, block, block_bytes = fmt.deq, fmt.block, fmt.block_bytes

    @njit(inline="always", nogil=True)
    def deq_row(row, f16, out):
        for b in range(out.shape[0] // block):
            deq(row, b * block_bytes, f16, out, b * block)

    return deq_row


def _dot_row_of(fmt: Format) -> Kernel:
    """dot_row(row, f16, x, buf) -> row · x: the format's fused dot, else a block dequantized into buf, then dotted."""
    deq, dot, block, block_bytes = fmt.deq, fmt.dot, fmt.block, fmt.block_bytes

    @njit(inline="always", nogil=True)
    def fused(row, f16, x, buf):
        acc = np.float32(0.0)
        for b in range(x.shape[0] // block):
            acc += dot(row, b * block_bytes, f16, x, b * block)
        return acc

    @njit(inline="always", nogil=True)
    def via_deq(row, f16, x, buf):
        acc = np.float32(0.0)
        for b in range(x.shape[0] // block):
            deq(row, b * block_bytes, f16, buf, 0)
            for k in range(block):
                acc += buf[k] * x[b * block + k]
        return acc

    return fused if dot is not None else via_deq


deq_row = by_format({f.code: _deq_row_of(f) for f in QUANTIZED.values()}, "row, f16, out")
_dot_row = by_format({f.code: _dot_row_of(f) for f in QUANTIZED.values()}, "row, f16, x, buf")


@njit(parallel=True, cache=True, nogil=True)
def matvec(w, fmt, f16, x, out):
    """W (d, n) @ x (n,) -> out (d,)."""
    d = w.shape[0]
    n_chunks = min(d, 64)
    for c in prange(n_chunks):
        buf = np.empty(256, dtype=np.float32)  # a block's values, for formats without a fused dot
        for r in range(c * d // n_chunks, (c + 1) * d // n_chunks):
            out[r] = _dot_row(fmt, w[r], f16, x, buf)


@njit(parallel=True, cache=True, nogil=True)
def dequantize_rows(w, fmt, f16, r0, out):
    """W[r0 : r0 + k] (k, n) -> out (k, n) float32."""
    for i in prange(out.shape[0]):
        deq_row(fmt, w[r0 + i], f16, out[i])
