"""A mixture-of-experts pass's expert products in one parallel launch per matrix kind (gate, up, down), instead of
three small products per chosen expert (engine/moe.py).

The pass's (token, expert) choices are sorted by expert into "slots": segment i of the slots holds the tokens
that chose expert experts[i]. Every chosen expert's packed weight lies in one array of all the experts of its
tensor (`q_all`, `s_all`: moe.ExpertTensor's arena), so one launch reaches them all: its parallel items are
(segment, row group, up to PER_ITEM tokens), the weights of an item read once for its tokens, TILE at a time,
as packed.matmul runs one matrix. Each slot's row is bit for bit what packed.matmul (and so packed.matvec)
gives for that token and expert: the choice of kernel never changes a token's numbers.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .packed import PER_ITEM, ROWS, TILE, double_pairs, group_simd_tile, quantize_into


@njit(parallel=True, cache=True, nogil=True)
def quantize_slots(xs, rows, paired, xq, dx, xsum, xq2):
    """Row rows[i] of xs (t, n) quantized (as packed.matmul quantizes a token) into slot i of xq (T', n/32, 32),
    dx (T', n/32), xsum (T', n/32, 2) and, where `paired`, xq2 (T', n/32, 64); T' = len(rows) + TILE, the last
    TILE slots zeros (a tile that runs past a segment's end reads them; their results are dropped)."""
    t = xs.shape[0]
    nb = xq.shape[1]
    own_q = np.empty((t, nb, 32), dtype=np.int8)  # each distinct row quantized once, then copied to its slots
    own_d = np.empty((t, nb), dtype=np.float32)
    own_s = np.empty((t, nb, 2), dtype=np.int32)
    for i in prange(t):
        quantize_into(xs[i], own_q[i], own_d[i], own_s[i])
    n = rows.shape[0]
    for i in prange(xq.shape[0]):
        if i < n:
            xq[i] = own_q[rows[i]]
            dx[i] = own_d[rows[i]]
            xsum[i] = own_s[rows[i]]
        else:
            xq[i] = 0
            dx[i] = 0
            xsum[i] = 0
        if paired:
            double_pairs(xq[i], xq2[i])


def slot_buffers(n_slots: int, n: int, paired: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`quantize_slots`'s outputs for n_slots slots of n values (TILE padding slots included); xq2 empty where
    the format's kernels read quads."""
    t, nb = n_slots + TILE, n // 32
    xq2 = np.empty((t if paired else 0, nb, 64), dtype=np.int8)
    return np.empty((t, nb, 32), np.int8), np.empty((t, nb), np.float32), np.empty((t, nb, 2), np.int32), xq2


@njit(parallel=True, cache=True, nogil=True)
def experts_matmul(q_all, s_all, fmt, experts, starts, xq, xq2, dx, xsum, out):
    """out[starts[i] : starts[i+1]] = the slots' rows @ W_e.T for e = experts[i], every segment i.

    q_all (n_expert, G, nb, ...), s_all (n_expert, G, nb, NS, ROWS): the tensor's packed experts (those named in
    experts packed); xq, dx, xsum, xq2 from `quantize_slots`; out (n_slots, d) float32.
    """
    m = experts.shape[0]
    n_groups = q_all.shape[1]
    d = out.shape[1]
    first = np.zeros(m + 1, dtype=np.int64)  # segment i's first item
    for i in range(m):
        first[i + 1] = first[i] + n_groups * ((starts[i + 1] - starts[i] + PER_ITEM - 1) // PER_ITEM)
    for item in prange(first[m]):
        i = np.searchsorted(first, item, side="right") - 1
        n_chunks = (starts[i + 1] - starts[i] + PER_ITEM - 1) // PER_ITEM
        g = (item - first[i]) // n_chunks
        t0 = starts[i] + ((item - first[i]) % n_chunks) * PER_ITEM
        t1 = min(starts[i + 1], t0 + PER_ITEM)
        q = q_all[experts[i]]
        s = s_all[experts[i]]
        rows = min(ROWS, d - g * ROWS)
        acc = np.empty((TILE, ROWS), dtype=np.float32)
        for k0 in range(t0, t1, TILE):
            group_simd_tile(q, s, fmt, g, xq, xq2, dx, xsum, k0, acc)
            for k in range(min(TILE, t1 - k0)):
                for r in range(rows):
                    out[k0 + k, g * ROWS + r] = acc[k, r]


@njit(parallel=True, cache=True, nogil=True)
def weighted_sum(y, slots, weights, out):
    """out (t, d) = for each token, sum over its k chosen experts of weight · y[slot], added in the slots' order
    (ascending expert, as moe.router_ffn adds them one expert at a time), from zero.

    y (n_slots, d) the experts' outputs in slot order; slots (t, k) each token's slots, ascending; weights (t, k)
    float32 their routing weights."""
    for i in prange(out.shape[0]):
        out[i] = 0
        for j in range(slots.shape[1]):
            w = weights[i, j]
            p = slots[i, j]
            for c in range(out.shape[1]):
                out[i, c] += w * y[p, c]
