"""Products with float16 and bfloat16 weights, read as stored (2 bytes a weight) and widened in registers.

Decode is memory-bound: one pass over W's 16-bit values, rows split between the threads, each row's dot
product in float32 (vcvtph2ps and FMA where the CPU has them), each row asking L2 for the row PREFETCH_AHEAD
bytes further on first, as the packed kernels do (emit.py): SmolLM2 F16's 211 products took 10.1 ms a token
against 14.8-18.4 without (Intel Xeon, 2 threads), the hardware prefetcher alone reaching 13-18 GB/s of 27.
Prefill widens blocks of BLOCK_ROWS rows to float32 and multiplies them with BLAS's sgemm, the blocks in
parallel (as attention.attend_causal does).
Activations stay float32: the results are W @ x up to float32 summation order.

    w     uint16 (d, n)  the weight's bit patterns, as the file stores them
    bf16  bool           bfloat16 (the top half of a float32) rather than IEEE half
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..formats.emit import PREFETCH_AHEAD, prefetch_l2
from .attention import half_to_float, sgemm

# Rows of W widened at a time in `matmul`, about: 96 x n float32 stays in L2. The blocks are as many as a multiple
# of the threads, so that none waits on a last one: SmolLM2's seven prompt products of a layer at 256 tokens
# (2 threads, Zen 5) took 6.75 ms in blocks of 64 rows, 5.2 ms in an even count of ~96, 5.5-5.9 ms in ~32-288.
BLOCK_ROWS = 96


@intrinsic
def bf16_to_float(typingctx, h):
    """The float32 whose top half is the uint16 h (bfloat16 -> float32, exact)."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _prefetch_l2(typingctx, a, i):
    """Ask L2 for the cache line holding a[i] (a 1-D array); a hint that never faults, even past the end."""

    def codegen(context, builder, signature, args):
        prefetch_l2(builder, context.make_array(signature.args[0])(context, builder, args[0]).data, args[1])
        return context.get_dummy_value()

    return types.void(a, types.intp), codegen


@njit(inline="always", cache=True, nogil=True)
def _prefetch_ahead(w, r):
    """Ask L2 for the row of W about PREFETCH_AHEAD bytes after row r (the last row near the end): in a loop
    of its own, so that the dot product's loop still vectorizes."""
    n = w.shape[1]
    ahead = min(r + max(1, PREFETCH_AHEAD // (2 * n)), w.shape[0] - 1)
    row = w[ahead]
    for c in range(0, n, 32):  # 32 values: one 64-byte line
        _prefetch_l2(row, c)


@njit(inline="always", cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _row_dot(w, r, x, bf16):
    """W[r] · x in float32."""
    acc = np.float32(0.0)
    if bf16:
        for j in range(x.shape[0]):
            acc += bf16_to_float(w[r, j]) * x[j]
    else:
        for j in range(x.shape[0]):
            acc += half_to_float(w[r, j]) * x[j]
    return acc


# The callers carry the fast-math flags too: Numba inlines `_row_dot` before LLVM sees it, under their flags.
@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def matvec(w, bf16, x, out):
    """W (d, n) @ x (n,) -> out (d,), rows in parallel."""
    for r in prange(w.shape[0]):
        _prefetch_ahead(w, r)
        out[r] = _row_dot(w, r, x, bf16)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def matvec_serial(w, bf16, x, out):
    """`matvec` on the calling thread alone: for weights too small to repay a parallel launch."""
    for r in range(w.shape[0]):
        _prefetch_ahead(w, r)
        out[r] = _row_dot(w, r, x, bf16)


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def matmul_rows(w, bf16, xs, out):
    """xs (t, n) @ W.T -> out (t, d), each token's row as `matvec` computes it alone (same dot, same order);
    rows of W in parallel, each read once for all the tokens."""
    for r in prange(w.shape[0]):
        for i in range(xs.shape[0]):
            out[i, r] = _row_dot(w, r, xs[i], bf16)


@njit(parallel=True, cache=True, nogil=True)
def matmul(sgemm_fn, w, bf16, xs, n_threads, out):
    """xs (t, n) float32 @ W.T -> out (t, d): each parallel item widens about BLOCK_ROWS rows of W and calls the
    single-threaded sgemm at address sgemm_fn on them (n_threads: Numba's thread count)."""
    t, n = xs.shape
    d = w.shape[0]
    n_blocks = min(d, n_threads * max(1, round(d / (BLOCK_ROWS * n_threads))))
    for blk in prange(n_blocks):
        r0 = blk * d // n_blocks
        m = (blk + 1) * d // n_blocks - r0
        wf = np.empty((m, n), dtype=np.float32)  # (m, n) this block's rows
        for i in range(m):
            if bf16:
                for j in range(n):
                    wf[i, j] = bf16_to_float(w[r0 + i, j])
            else:
                for j in range(n):
                    wf[i, j] = half_to_float(w[r0 + i, j])
        o = np.empty((t, m), dtype=np.float32)  # (t, m)
        sgemm(sgemm_fn, True, t, m, n, xs, n, wf, n, o, m)
        for i in range(t):
            for k in range(m):
                out[i, r0 + k] = o[i, k]
