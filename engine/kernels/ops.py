"""The attention wrapper of the kernel layer (see the package docstring, engine/kernels/__init__.py): a prompt's
queries over the float16 cache, sent to the one-token kernel, the row-by-row one or the blocked BLAS one.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads

from .. import cache_types
from ..cache_types import cache_bits
from . import attention, packed
from .products import blas_sgemm_address
from .scratch import Scratch

# Passes of up to this many tokens (a draft's check) attend each query as the one-token kernel does, so their
# logits are a plain decode's bit for bit and greedy output never leaves it at a near-tie; longer ones use BLAS.
SHORT_PASS = packed.SHORT_MAX


def causal_attention(
    q: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int,
    scale: float | None = None, window: int = 0, softcap: float = 0.0, out: np.ndarray | None = None,
    rowwise: bool = False, scratch: Scratch | None = None,
) -> np.ndarray:  # fmt: skip
    """Queries at positions start.. over the cached keys each one sees: up to its own position, and within
    the last `window` positions when window > 0.

    q (t, n_head, hd); kc, vc (n_kv, rows, width) of a cache type (engine/cache_types.py: float16 (.., hd), or
    uint8 q8_0 blocks), K and V each their own, position p in row p % rows -> (t, n_head·hd) float32,
    into out where given (except without BLAS: use the result). Scores are scale · q·k (default 1/√hd),
    soft-capped as cap·tanh(s/cap) when softcap > 0. Query head h reads kv head h // (n_head / n_kv). Blocks
    of queries run in parallel, each with single-threaded BLAS products (attention.attend_causal, its buffers
    from scratch where given); without a usable BLAS sgemm, the same arithmetic runs here in NumPy. Passes of
    up to SHORT_PASS queries, and any with rowwise, run each query through the one-token kernel instead
    (attention.attend_rows).
    """
    t, n_head, hd = q.shape
    scale = float(1.0 / np.sqrt(hd)) if scale is None else float(scale)
    q = np.ascontiguousarray(q, dtype=np.float32)
    kc16, vc16 = cache_bits(kc), cache_bits(vc)
    if t == 1:  # decode: the one-query kernel (as decode.layer's), no BLAS call for a single row
        out = np.empty((1, n_head * hd), dtype=np.float32) if out is None else out
        threads = get_num_threads()
        attention.attend_one(q.reshape(-1), kc16, vc16, start, n_head, scale, window, softcap, threads, out[0])
        return out
    if t <= SHORT_PASS or rowwise:
        out = np.empty((t, n_head * hd), dtype=np.float32) if out is None else out
        attention.attend_rows(q.reshape(t, -1), kc16, vc16, start, n_head, scale, window, softcap, out)
        return out
    fn = blas_sgemm_address()
    if fn:
        out = np.empty((t, n_head * hd), dtype=np.float32) if out is None else out
        threads = get_num_threads()
        size = attention.causal_work_size(t, n_head, kc.shape[0], hd, start, window, threads)
        work = scratch.take("attention blocks", (size,)) if scratch is not None else np.empty(size, np.float32)
        attention.attend_causal(fn, q, kc16, vc16, start, scale, window, softcap, threads, work, out)
        return out
    n_kv = kc.shape[0]
    group = n_head // n_kv
    lo = max(0, start - window + 1) if window > 0 else 0  # the oldest key any of these queries sees
    rows = np.arange(lo, start + t) % kc.shape[1]  # (n_keys,) cache rows in position order
    qg = np.ascontiguousarray(q.transpose(1, 0, 2)).reshape(n_kv, group * t, hd)  # rows (g, i) per kv head
    out = np.empty((n_kv, group * t, hd), dtype=np.float32)  # (n_kv, group·t, hd)
    for kv in range(n_kv):
        scores = np.matmul(qg[kv], cache_types.to_floats(np, kc[kv, rows]).T)  # (group·t, n_keys)
        attention.causal_softmax(scores, 0, t, start, lo, scale, window, softcap)
        np.matmul(scores, cache_types.to_floats(np, vc[kv, rows]), out=out[kv])
    return out.reshape(n_head, t, hd).transpose(1, 0, 2).reshape(t, n_head * hd)
