"""Attention over the KV cache, compiled: one query per head (decode), and blocks of queries (prefill), whose
two products go to BLAS's sgemm, called from the parallel loop so that both cores run one block each.

The gated activations (SwiGLU, GeGLU) live here too, beside the exp and tanh they share with the softmax.

Every attention kernel takes the layer's description as arguments: the score scale, a sliding window (0: none)
and a soft-cap (0: none). A cache of fewer rows than positions is a ring: position p lives in row p % rows.

Numerics follow model.attention (the NumPy reference) up to summation order and an exp that is within 1e-7
relative of the exact one, so results agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# Scores of one parallel block are at most this many floats (16 MB): long contexts get more, smaller blocks.
_MAX_BLOCK_SCORES = 1 << 22
# Queries per block of a prompt's attention (attend_causal): a block computes its scores with every key up to
# its last query, so smaller blocks skip more of the causal mask, and larger ones make larger products.
QUERY_BLOCK = 32


@intrinsic
def _int_bits_as_float(typingctx, i):
    """The float32 whose bit pattern is the int32 i."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def half_to_float(typingctx, h):
    """The float16 whose bit pattern is the uint16 h, as float32 (exact; vcvtph2ps where the CPU has F16C)."""

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def float_to_half(typingctx, x):
    """The bit pattern of float32 x rounded to float16: nearest, ties to even, overflow to inf (as NumPy)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@njit(inline="always", cache=True, nogil=True, fastmath={"contract"})
def exp_nonpositive(x):
    """exp(x) for x <= 0 in float32, within 1e-7 relative (Cephes' expf), in plain arithmetic that vectorizes.

    x = n·ln2 + r with |r| <= ln2/2; exp(r) by its degree-7 polynomial; 2^n assembled in the exponent bits.
    """
    x = max(x, np.float32(-87.0))  # exp(-87) ~ 1.6e-38, the smallest normal float32's neighbourhood
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693145751953125)  # ln2 in two parts, so that n·ln2 is exact
    r = r - n * np.float32(1.428606765330187e-06)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _int_bits_as_float((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(inline="always", cache=True, nogil=True, fastmath={"contract"})
def silu(g):
    """g · sigmoid(g) in float32, through exp of -|g| only (exp_nonpositive): vectorizes, never overflows."""
    e = exp_nonpositive(-abs(g))
    sig = np.float32(1.0) / (np.float32(1.0) + e) if g >= 0 else e / (np.float32(1.0) + e)
    return g * sig


@njit(parallel=True, cache=True, nogil=True, fastmath={"contract"})
def swiglu(gate, up, out):
    """out (t, d_ff) = silu(gate) * up, rows in parallel."""
    for i in prange(gate.shape[0]):
        for j in range(gate.shape[1]):
            out[i, j] = silu(gate[i, j]) * up[i, j]


@njit(inline="always", cache=True, nogil=True)
def gelu_half(g):
    """GELU (tanh form) as ggml's CPU backend computes it: 0 below -10, g above 10, else its table of float16
    results at g rounded to float16 (GGML_GELU_FP16), so that a gated FFN rounds as llama.cpp's does."""
    if g <= np.float32(-10.0):
        return np.float32(0.0)
    if g >= np.float32(10.0):
        return g
    x = half_to_float(float_to_half(g))
    y = (
        np.float32(0.5)
        * x
        * (np.float32(1.0) + np.tanh(np.float32(0.7978845608) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)))
    )
    return half_to_float(float_to_half(y))


@njit(parallel=True, cache=True, nogil=True)
def geglu(gate, up, out):
    """out (t, d_ff) = gelu_half(gate) * up, rows in parallel."""
    for i in prange(gate.shape[0]):
        for j in range(gate.shape[1]):
            out[i, j] = gelu_half(gate[i, j]) * up[i, j]


@njit(inline="always", cache=True, nogil=True)
def soft_cap(s, cap):
    """cap · tanh(s / cap): scores squashed into (-cap, cap)."""
    return cap * np.tanh(s / cap)


@njit(inline="always", cache=True, nogil=True)
def first_key(pos, window):
    """The oldest position a query at `pos` sees: pos - window + 1 in a sliding window, else 0."""
    return max(0, pos - window + 1) if window > 0 else 0


# Below this many query·key multiply-adds (positions x query heads x head size) one decode step's attention
# runs on the calling thread: a parallel launch costs a few microseconds, what ~30k multiply-adds take.
_PARALLEL_ATTEND_MIN = 1 << 17


@njit(parallel=True, cache=True, nogil=True)
def attend_one(q, kc, vc, pos, n_head, scale, window, softcap, threads, out):
    """One query per head, at position pos, over the cached positions it sees (first_key(pos, window)..pos).

    q (n_head·hd,); kc, vc (n_kv, rows, hd) float16 bit patterns (uint16), position p in row p % rows ->
    out (n_head·hd,). Scores are scale · q·k, soft-capped when softcap > 0. Query head h reads kv head
    h // (n_head/n_kv).

    Long contexts run on `threads` threads: one item per kv head, or, where the kv heads do not share evenly
    between the threads, per part of a kv head's query heads. Each head's arithmetic is the same either way
    (`attend_heads`), so the result does not depend on the split.
    """
    n_kv, hd = kc.shape[0], kc.shape[2]
    group = n_head // n_kv
    n_pos = pos + 1 - first_key(pos, window)
    if threads == 1 or n_pos * n_head * hd < _PARALLEL_ATTEND_MIN:
        for kv in range(n_kv):
            attend_heads(q, kc[kv], vc[kv], kv * group, group, pos, scale, window, softcap, out)
        return
    splits = 1 if n_kv % threads == 0 else min(group, threads)
    for item in prange(n_kv * splits):
        kv, part = item // splits, item % splits
        g0, g1 = part * group // splits, (part + 1) * group // splits
        attend_heads(q, kc[kv], vc[kv], kv * group + g0, g1 - g0, pos, scale, window, softcap, out)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def attend_heads(q, kc, vc, h0, n_g, pos, scale, window, softcap, out):
    """`attend_one` for the n_g query heads h0 .. h0 + n_g - 1, which read one kv head: kc, vc (rows, hd).
    Each cached row is read once for all of them.

    The loops index slices (a row of the cache, a head of q) with their own loop counters: an index Numba
    cannot prove non-negative gets a wrap-around check, which keeps the loop from vectorizing (6x slower).
    """
    rows, hd = kc.shape
    lo = first_key(pos, window)
    n_pos = pos + 1 - lo
    scale = np.float32(scale)
    cap = np.float32(softcap)
    qh = q[h0 * hd : (h0 + n_g) * hd].reshape(n_g, hd)  # (n_g, hd)
    scores = np.empty((n_g, n_pos), dtype=np.float32)  # (n_g, n_pos)
    for p in range(n_pos):
        krow = kc[(lo + p) % rows]
        for g in range(n_g):
            qg = qh[g]
            s = np.float32(0.0)
            for i in range(hd):
                s += qg[i] * half_to_float(krow[i])
            s *= scale
            scores[g, p] = soft_cap(s, cap) if cap > 0 else s
    for g in range(n_g):  # softmax over positions
        sg = scores[g]
        top = np.float32(-np.inf)
        for p in range(n_pos):
            top = max(top, sg[p])
        total = np.float32(0.0)
        for p in range(n_pos):
            e = exp_nonpositive(sg[p] - top)
            sg[p] = e
            total += e
        inv = np.float32(1.0) / total
        for p in range(n_pos):
            sg[p] *= inv
    acc = np.zeros((n_g, hd), dtype=np.float32)  # (n_g, hd)
    for p in range(n_pos):
        vrow = vc[(lo + p) % rows]
        for g in range(n_g):
            wp = scores[g, p]
            ag = acc[g]
            for i in range(hd):
                ag[i] += wp * half_to_float(vrow[i])
    out[h0 * hd : (h0 + n_g) * hd] = acc.reshape(-1)


@njit(inline="always", cache=True, nogil=True, fastmath=True)
def _row_max(row, first, last):
    """max(row[first:last]), last > first. Seeded with row[first] rather than -inf, so that the fast-math
    reduction (which assumes finite values) vectorizes; the scores are finite products of finite cache entries."""
    top = row[first]
    for p in range(first + 1, last):
        top = max(top, row[p])
    return top


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def causal_exp(scores, i0, group, start, lo, scale, window, softcap, inv_total):
    """scores (rows, K) in place -> exp(s' - max s') over the keys each row sees, 0 elsewhere, with
    s' = scale · s (soft-capped when softcap > 0), and inv_total (rows,) = 1 / the sum of each row:
    softmax(s') = scores · inv_total[:, None], which the caller applies to the (smaller) product with the
    values instead. Column j is the key at position lo + j. Rows run over queries, then the `group` heads
    sharing a kv head: row r is query i0 + r // group, at position start + that; it sees keys
    first_key(its position, window) up to its own."""
    rows, n_keys = scores.shape
    scale = np.float32(scale)
    cap = np.float32(softcap)
    for r in range(rows):
        pos = start + i0 + r // group
        first = first_key(pos, window) - lo
        last = pos - lo + 1
        row = scores[r]
        if cap > 0:
            for p in range(first, last):
                row[p] = soft_cap(row[p] * scale, cap)
            step = np.float32(1.0)
        else:
            step = scale
        top = _row_max(row, first, last)
        total = np.float32(0.0)
        for p in range(first, last):
            e = exp_nonpositive((row[p] - top) * step)
            row[p] = e
            total += e
        inv_total[r] = np.float32(1.0) / total
        for p in range(first):
            row[p] = 0.0
        for p in range(last, n_keys):
            row[p] = 0.0


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def causal_softmax(scores, i0, group, start, lo, scale, window, softcap):
    """scores (rows, K) in place -> attention weights softmax(s'), rows and columns as in `causal_exp`."""
    inv_total = np.empty(scores.shape[0], dtype=np.float32)
    causal_exp(scores, i0, group, start, lo, scale, window, softcap, inv_total)
    for r in range(scores.shape[0]):
        scores[r] *= inv_total[r]


@intrinsic
def sgemm(typingctx, fn, transpose_b, m, n, k, a, lda, b, ldb, c, ldc):
    """C (m, n) = A (m, k) @ op(B), op(B) = Bᵀ when transpose_b: a call of the cblas_sgemm (row major, 64-bit
    integers) whose address is `fn`. The address is an argument, not a constant, so the kernel stays cacheable."""
    sig = types.void(types.int64, types.boolean, types.int64, types.int64, types.int64, a, types.int64, b,
                     types.int64, c, types.int64)  # fmt: skip

    def codegen(context, builder, signature, args):
        fn_, transpose_, m_, n_, k_, a_, lda_, b_, ldb_, c_, ldc_ = args
        i32, i64, f32, ptr = ir.IntType(32), ir.IntType(64), ir.FloatType(), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64])

        def data(ty, val):
            return builder.bitcast(context.make_array(ty)(context, builder, val).data, ptr)

        row_major, no_trans, trans = ir.Constant(i32, 101), ir.Constant(i32, 111), ir.Constant(i32, 112)
        builder.call(
            builder.inttoptr(fn_, fnty.as_pointer()),
            [row_major, no_trans, builder.select(transpose_, trans, no_trans), m_, n_, k_, ir.Constant(f32, 1.0),
             data(signature.args[5], a_), lda_, data(signature.args[7], b_), ldb_, ir.Constant(f32, 0.0),
             data(signature.args[9], c_), ldc_],
        )  # fmt: skip
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, cache=True, nogil=True)
def attend_causal(sgemm_fn, q, kc, vc, start, scale, window, softcap, n_threads, out):
    """t queries at positions start.., each over the cached keys it sees (first_key(pos, window)..pos).

    q (t, n_head, hd) float32; kc, vc (n_kv, cache_rows, hd) float16 bit patterns (uint16), position p in row
    p % cache_rows, holding every position the queries see -> out (t, n_head·hd).

    The queries go in blocks (`_query_blocks`), each block with the heads that share one kv head: rows
    r = i·group + g (query i of the block, head g of the group). A block takes the keys and values from its
    first query's oldest key to its last query's own, in float32, and computes scores = Q Kᵀ and out = P V by
    sgemm (at address sgemm_fn), the causal softmax between: so the masked corner of the scores is computed only
    within a block. A parallel item is a block and its mirror (the first with the last, ...) of one kv head, so
    that every item has about the same work.
    """
    t, n_head, hd = q.shape
    n_kv, cache_rows = kc.shape[0], kc.shape[1]
    group = n_head // n_kv
    n_blocks = _query_blocks(t, group, start + t - first_key(start, window), n_kv, n_threads)
    n_pairs = (n_blocks + 1) // 2
    for item in prange(n_kv * n_pairs):
        kv = item // n_pairs
        p = item % n_pairs
        for side in range(2):
            b = p if side == 0 else n_blocks - 1 - p
            if side == 1 and b == p:
                continue
            i0 = b * t // n_blocks
            i1 = (b + 1) * t // n_blocks
            lo = first_key(start + i0, window)  # the oldest key the block's queries see
            n_keys = start + i1 - lo
            m = (i1 - i0) * group
            a = np.empty((m, hd), dtype=np.float32)  # (m, hd) the block's queries
            for r in range(m):
                a[r] = q[i0 + r // group, kv * group + r % group]
            keys = np.empty((n_keys, hd), dtype=np.float32)  # (n_keys, hd)
            values = np.empty((n_keys, hd), dtype=np.float32)
            for k in range(n_keys):
                row = (lo + k) % cache_rows
                for j in range(hd):
                    keys[k, j] = half_to_float(kc[kv, row, j])
                    values[k, j] = half_to_float(vc[kv, row, j])
            scores = np.empty((m, n_keys), dtype=np.float32)  # (m, n_keys)
            sgemm(sgemm_fn, True, m, n_keys, hd, a, hd, keys, hd, scores, n_keys)
            inv_total = np.empty(m, dtype=np.float32)
            causal_exp(scores, i0, group, start, lo, scale, window, softcap, inv_total)
            o = np.empty((m, hd), dtype=np.float32)  # (m, hd)
            sgemm(sgemm_fn, False, m, hd, n_keys, scores, n_keys, values, hd, o, hd)
            for r in range(m):
                h = kv * group + r % group
                for j in range(hd):
                    out[i0 + r // group, h * hd + j] = o[r, j] * inv_total[r]


@njit(cache=True, nogil=True)
def _query_blocks(t, group, most_keys, n_kv, n_threads):
    """How many blocks attend_causal splits t queries into: blocks of QUERY_BLOCK queries or fewer (fewer when
    a block's scores, group·queries x most_keys, would pass _MAX_BLOCK_SCORES), and enough block pairs for every
    thread."""
    per_block = max(1, min(QUERY_BLOCK, _MAX_BLOCK_SCORES // (group * most_keys)))
    n_blocks = (t + per_block - 1) // per_block
    per_kv = (n_threads + n_kv - 1) // n_kv  # items each kv head needs for all threads to have one
    return max(n_blocks, min(t, 2 * per_kv))
