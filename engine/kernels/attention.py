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
from numba import get_thread_id, njit, prange, types
from numba.extending import intrinsic, overload

from ..runtime import configure_numba
from .attention_tiles import (
    HALVES_STEP,
    ROW_STEP,
    TILE,
    WIDE_VALUES,
    tile_scores_1,
    tile_scores_2,
    tile_values_1,
    tile_values_2,
    tile_values_4,
    widen_halves,
    widen_q8_0,
)

configure_numba()  # the kernel cache folder before the @njit(cache=True) below, even when imported directly

# Scores of one parallel block are at most this many floats (16 MB): long contexts get more, smaller blocks.
_MAX_BLOCK_SCORES = 1 << 22


@intrinsic
def int_bits_as_float(typingctx, i):
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
    return p * int_bits_as_float((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(inline="always", cache=True, nogil=True, fastmath={"contract"})
def silu(g):
    """g · sigmoid(g) in float32, through exp of -|g| only (exp_nonpositive): vectorizes, never overflows."""
    e = exp_nonpositive(-abs(g))
    sig = np.float32(1.0) / (np.float32(1.0) + e) if g >= 0 else e / (np.float32(1.0) + e)
    return g * sig


# The gated activations row by row, one compiled loop each that the prompt path (swiglu, geglu) and the one-token
# layer (decode.layer) both call: inlined into each caller, silu took the caller's fast-math flags, and 0.5% of
# its values came out a rounding apart, enough to move a drafted token's logits off a plain decode's. No FMA
# contraction, as the one-token layer computed it before: with it, Qwen 0.5B's greedy golden run left
# llama.cpp's tokens at step 2 by 0.155 logits (tests/engine/test_golden.py, Intel Xeon).
# silu runs as its own loop over gate, in place: a loop that reads gate and up and writes out, where out is one of
# them, fails the vectorizer's runtime overlap check and runs scalar, and under Python's error model the
# division's zero check kept even a separate output's loop scalar. On Zen 5, 8,960 values: 4.4 ns a value
# before, 0.53 now, with the same results (NumPy's error model: a zero divisor gives inf, never raises).


@njit(cache=True, nogil=True, error_model="numpy")
def swiglu_row(gate, up, out):
    """out (n,) = silu(gate) * up, gate overwritten with silu(gate); out may be gate or up."""
    for j in range(gate.shape[0]):
        gate[j] = silu(gate[j])
    for j in range(gate.shape[0]):
        out[j] = gate[j] * up[j]


@njit(parallel=True, cache=True, nogil=True)
def swiglu(gate, up, out):
    """out (t, d_ff) = silu(gate) * up, rows in parallel; gate overwritten with silu(gate)."""
    for i in prange(gate.shape[0]):
        swiglu_row(gate[i], up[i], out[i])


@njit(cache=True, nogil=True)
def _gelu_half_table():
    """GELU (tanh form) at every float16 value, rounded to float16 (as float32): ggml's GGML_GELU_FP16 table."""
    table = np.empty(1 << 16, dtype=np.float32)
    for h in range(1 << 16):
        x = half_to_float(np.uint16(h))
        inner = np.float32(0.7978845608) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)
        y = np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))
        table[h] = half_to_float(float_to_half(y))
    return table


_gelu_table: list[np.ndarray] = []


def gelu_table() -> np.ndarray:
    """`_gelu_half_table()`, built once, on first use (an argument of the kernels that look it up: a table
    built at import would start Numba while the module loads, which left the process 27 MB larger)."""
    if not _gelu_table:
        _gelu_table.append(_gelu_half_table())
    return _gelu_table[0]


# A table lookup instead of a tanh per value (a libm call, which keeps the loop scalar): Gemma 3 270M's
# 256-token prompt spent 80 ms of its 272 in GeGLU on Zen 5.


@njit(inline="always", cache=True, nogil=True)
def gelu_half(g, table):
    """GELU (tanh form) as ggml's CPU backend computes it: 0 below -10, g above 10, else its table of float16
    results at g rounded to float16 (GGML_GELU_FP16; `table` = gelu_table()), so that a gated FFN rounds as
    llama.cpp's does."""
    if g <= np.float32(-10.0):
        return np.float32(0.0)
    if g >= np.float32(10.0):
        return g
    return table[float_to_half(g)]


@njit(cache=True, nogil=True)
def geglu_row(gate, up, out, table):
    """out (n,) = gelu_half(gate) * up; out may be up. table: gelu_table()."""
    for j in range(gate.shape[0]):
        out[j] = gelu_half(gate[j], table) * up[j]


@njit(parallel=True, cache=True, nogil=True)
def geglu(gate, up, out, table):
    """out (t, d_ff) = gelu_half(gate) * up, rows in parallel. table: gelu_table()."""
    for i in prange(gate.shape[0]):
        geglu_row(gate[i], up[i], out[i], table)


@njit(inline="always", cache=True, nogil=True)
def soft_cap(s, cap):
    """cap · tanh(s / cap): scores squashed into (-cap, cap)."""
    return cap * np.tanh(s / cap)


@njit(inline="always", cache=True, nogil=True)
def first_key(pos, window):
    """The oldest position a query at `pos` sees: pos - window + 1 in a sliding window, else 0."""
    return max(0, pos - window + 1) if window > 0 else 0


# Below this many query·key multiply-adds (positions x query heads x head size) one decode step's attention
# runs on the calling thread. Measured on an Intel Xeon (2 threads, launches back to back): serial and parallel
# break even at 15-25k (Qwen2.5 0.5B's heads at 16 positions: 4.5 µs either way; at 65, 14.6 serial, 9.5 parallel).
_PARALLEL_ATTEND_MIN = 1 << 14


@njit(parallel=True, cache=True, nogil=True)
def attend_one(q, kc, vc, pos, n_head, scale, window, softcap, threads, out):
    """One query per head, at position pos, over the cached positions it sees (first_key(pos, window)..pos).

    q (n_head·hd,); kc, vc (n_kv, rows, width): cached rows, float16 bit patterns (uint16, width hd) or q8_0 blocks
    (uint8, engine/cache_types.py), each its own type; position p in row p % rows -> out (n_head·hd,). Scores are
    scale · q·k, soft-capped when softcap > 0. Query head h reads kv head h // (n_head/n_kv).

    Long contexts run on `threads` threads: one item per kv head, or, where the kv heads do not share evenly
    between the threads, per part of a kv head's query heads. Each head's arithmetic is the same either way
    (`attend_heads`), so the result does not depend on the split.
    """
    n_kv, hd = kc.shape[0], q.shape[0] // n_head
    group = n_head // n_kv
    n_pos = pos + 1 - first_key(pos, window)
    if threads == 1 or n_pos * n_head * hd < _PARALLEL_ATTEND_MIN:
        for kv in range(n_kv):
            attend_heads(q, kc[kv], vc[kv], kv * group, group, hd, pos, scale, window, softcap, out)
        return
    splits = 1 if n_kv % threads == 0 else min(group, threads)
    for item in prange(n_kv * splits):
        kv, part = item // splits, item % splits
        g0, g1 = part * group // splits, (part + 1) * group // splits
        attend_heads(q, kc[kv], vc[kv], kv * group + g0, g1 - g0, hd, pos, scale, window, softcap, out)


@njit(parallel=True, cache=True, nogil=True)
def attend_rows(q, kc, vc, start, n_head, scale, window, softcap, out):
    """A short pass's queries, row i at position start + i, each as `attend_one` attends it (so a drafted
    token's pass gives the logits decoding it alone would): q, out (t, n_head·hd); kc, vc as attend_one's."""
    n_kv, hd = kc.shape[0], q.shape[1] // n_head
    group = n_head // n_kv
    for item in prange(q.shape[0] * n_kv):
        i, kv = item // n_kv, item % n_kv
        attend_heads(q[i], kc[kv], vc[kv], kv * group, group, hd, start + i, scale, window, softcap, out[i])


@njit(inline="always", cache=True, nogil=True)
def _widen_tile(cache, first, m, hd, width, tile):
    """Cached positions first .. first + m - 1 (m <= TILE; position p in row p % rows) -> tile (TILE·width,)
    float32, row r at r·width, its last width - hd values left as they are (zero); rows m .. TILE-1 zeroed."""
    rows = cache.shape[0]
    row = first % rows  # one division a tile: a remainder per row cost as much as widening it
    for r in range(m):
        cache_row_floats(cache[row], tile[r * width : r * width + hd])
        row = row + 1 if row + 1 < rows else 0
    if m < TILE:
        tile[m * width :] = 0.0


@njit(inline="always", cache=True, nogil=True)
def _tile_scores(qp, width, tile, scale, scores, span, p0, n_g):
    """scores[g·span + p0 + r] = scale · qp[g·width :][:width] · tile row r, for each head g < n_g and tile row r:
    two heads at a time (each row read once for both), then the odd one alone."""
    g = 0
    while n_g - g >= 2:
        tile_scores_2(qp, g * width, width, tile, width, scale, scores, g * span + p0, span)
        g += 2
    if g < n_g:
        tile_scores_1(qp, g * width, width, tile, width, scale, scores, g * span + p0, span)


@njit(inline="always", cache=True, nogil=True)
def _tile_values(scores, span, p0, tile, width, acc, n_g):
    """acc[g·width :][:width] += Σ_r scores[g·span + p0 + r] · tile row r, for each head g < n_g: as many heads
    at a time as the registers hold (each row read once for them), then pairs, then one."""
    g = 0
    if WIDE_VALUES:
        while n_g - g >= 4:
            tile_values_4(scores, g * span + p0, span, tile, width, acc, g * width, width)
            g += 4
    while n_g - g >= 2:
        tile_values_2(scores, g * span + p0, span, tile, width, acc, g * width, width)
        g += 2
    if g < n_g:
        tile_values_1(scores, g * span + p0, span, tile, width, acc, g * width, width)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def attend_heads(q, kc, vc, h0, n_g, hd, pos, scale, window, softcap, out):
    """`attend_one` for the n_g query heads h0 .. h0 + n_g - 1, which read one kv head: kc, vc (rows, width),
    cached rows of either type. The positions go TILE at a time: each cached row is widened to float32 once
    (`cache_row_floats`), then read by every query head of the group (attention_tiles.py)."""
    lo = first_key(pos, window)
    n_pos = pos + 1 - lo
    width = (hd + ROW_STEP - 1) // ROW_STEP * ROW_STEP  # a row's floats, padded with zeros (tile_values' step)
    n_tiles = (n_pos + TILE - 1) // TILE
    span = n_tiles * TILE
    cap = np.float32(softcap)
    qp = np.zeros(n_g * width, dtype=np.float32)  # (n_g, width) the group's queries
    for g in range(n_g):
        qp[g * width : g * width + hd] = q[(h0 + g) * hd : (h0 + g + 1) * hd]
    tile = np.zeros(TILE * width, dtype=np.float32)  # (TILE, width) one tile of cached rows
    scores = np.empty(n_g * span, dtype=np.float32)  # (n_g, span)
    for t in range(n_tiles):
        _widen_tile(kc, lo + t * TILE, min(TILE, n_pos - t * TILE), hd, width, tile)
        _tile_scores(qp, width, tile, scale, scores, span, t * TILE, n_g)
    for g in range(n_g):
        sg = scores[g * span : g * span + n_pos]
        if cap > 0:
            for p in range(n_pos):
                sg[p] = soft_cap(sg[p], cap)
        _softmax(sg)
        scores[g * span + n_pos : (g + 1) * span] = 0.0  # the last tile's unused rows weigh nothing
    acc = np.zeros(n_g * width, dtype=np.float32)  # (n_g, width)
    for t in range(n_tiles):
        _widen_tile(vc, lo + t * TILE, min(TILE, n_pos - t * TILE), hd, width, tile)
        _tile_values(scores, span, t * TILE, tile, width, acc, n_g)
    for g in range(n_g):
        out[(h0 + g) * hd : (h0 + g + 1) * hd] = acc[g * width : g * width + hd]


# ---- cached rows of either type (engine/cache_types.py): f16 as uint16 bit patterns, q8_0 as ggml's blocks ----
# Either is widened to float32 once a row (attention_tiles.py, in registers) and then read by every query head of
# its group, as ggml's CPU attention converts a quantized V row before accumulating it. Dotting K as int8 against
# a query quantized to int8 per 32 (ggml's vec_dot_q8_0_q8_0) would round the query too.


@njit(cache=True, nogil=True)
def quantize_q8_0(x, row):
    """x (n,) float32 -> row (n/32·34,) uint8: ggml's block_q8_0 per 32 values, d = max|x|/127 as a half, then
    qs = roundf(x / d) as int8 (C's roundf: halves away from zero; as quantize_row_q8_0_ref and gguf-py)."""
    for b in range(x.shape[0] // 32):
        o = b * 34
        xb = x[b * 32 : b * 32 + 32]
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(xb[j]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
        bits = np.int32(float_to_half(d))
        row[o] = np.uint8(bits & 0xFF)
        row[o + 1] = np.uint8((bits >> 8) & 0xFF)
        for j in range(32):
            v = xb[j] * inv
            a = abs(v)
            whole = np.floor(a)
            r = np.int32(whole + np.floor(np.float32(2.0) * (a - whole)))
            row[o + 2 + j] = np.uint8((r if v >= 0 else -r) & 0xFF)


@njit(inline="always", cache=True, nogil=True)
def dequantize_q8_0(row, out):
    """row (n/32·34,) uint8 of q8_0 blocks -> out (n,) float32 = d · qs."""
    widen_q8_0(row, row.shape[0] // 34, out)


@njit(inline="always", cache=True, nogil=True)
def widen_f16(row, out):
    """row (n,) float16 bit patterns -> out (n,) float32 (exact)."""
    n = out.shape[0]
    widen_halves(row, n, out)
    for j in range(n - n % HALVES_STEP, n):
        out[j] = half_to_float(row[j])


@njit(cache=True, nogil=True)
def narrow_f16(x, row):
    """x (n,) float32 -> row (n,) float16 bit patterns, rounded to nearest (ties to even)."""
    for j in range(x.shape[0]):
        row[j] = float_to_half(x[j])


def cache_row_floats(row, out):
    """A cached row (width,) of either type -> out (hd,) float32. Compiled code only."""
    raise NotImplementedError("attention.cache_row_floats runs inside compiled kernels only")


@overload(cache_row_floats, inline="always", jit_options={"nogil": True})
def _cache_row_floats(row, out):
    if row.dtype == types.uint8:
        return lambda row, out: dequantize_q8_0(row, out)
    return lambda row, out: widen_f16(row, out)


def store_cache_row(x, row):
    """x (hd,) float32 -> the cached row (width,) of its type (row's dtype). Compiled code only."""
    raise NotImplementedError("attention.store_cache_row runs inside compiled kernels only")


@overload(store_cache_row, jit_options={"nogil": True})
def _store_cache_row(x, row):
    if row.dtype == types.uint8:
        return lambda x, row: quantize_q8_0(x, row)
    return lambda x, row: narrow_f16(x, row)


@njit(inline="always", cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _softmax(scores):
    """scores (n,) in place -> their softmax."""
    top = _row_max(scores, 0, scores.shape[0])
    total = np.float32(0.0)
    for p in range(scores.shape[0]):
        e = exp_nonpositive(scores[p] - top)
        scores[p] = e
        total += e
    inv = np.float32(1.0) / total
    for p in range(scores.shape[0]):
        scores[p] *= inv


@njit(inline="always", cache=True, nogil=True, fastmath=True)
def _row_max(row, first, last):
    """max(row[first:last]), last > first. Seeded with row[first] rather than -inf, so that the fast-math
    reduction (which assumes finite values) vectorizes; the scores are finite products of finite cache entries."""
    top = row[first]
    for p in range(first + 1, last):
        top = max(top, row[p])
    return top


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def causal_exp(scores, r0, t, start, lo, scale, window, softcap, inv_total):
    """scores (rows, K) in place -> exp(s' - max s') over the keys each row sees, 0 elsewhere, with
    s' = scale · s (soft-capped when softcap > 0), and inv_total (rows,) = 1 / the sum of each row:
    softmax(s') = scores · inv_total[:, None], which the caller applies to the (smaller) product with the
    values instead. Column j is the key at position lo + j. Row r is query (r0 + r) % t, at position start +
    that (rows run over heads, then queries); it sees keys first_key(its position, window) up to its own."""
    rows = scores.shape[0]
    scale = np.float32(scale)
    cap = np.float32(softcap)
    for r in range(rows):
        pos = start + (r0 + r) % t
        first = first_key(pos, window) - lo
        last = pos - lo + 1
        row = scores[r]
        # The loops run over a view from 0: over range(first, last) they compiled 4x slower (Zen 5, 384 x 256
        # scores: 28 -> 7 ms for 180 blocks), a start known only at run time defeating the vectorizer.
        seen = row[first:last]
        if cap > 0:
            for p in range(seen.shape[0]):
                seen[p] = soft_cap(seen[p] * scale, cap)
            step = np.float32(1.0)
        else:
            step = scale
        top = _row_max(seen, 0, seen.shape[0])
        total = 0.0  # in float64, as ggml's softmax sums (ggml_vec_soft_max_f32)
        for p in range(seen.shape[0]):
            e = exp_nonpositive((seen[p] - top) * step)
            seen[p] = e
            total += e
        inv_total[r] = np.float32(1.0 / total)
        row[:first] = 0.0
        row[last:] = 0.0


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def causal_softmax(scores, r0, t, start, lo, scale, window, softcap):
    """scores (rows, K) in place -> attention weights softmax(s'), rows and columns as in `causal_exp`."""
    inv_total = np.empty(scores.shape[0], dtype=np.float32)
    causal_exp(scores, r0, t, start, lo, scale, window, softcap, inv_total)
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


@njit(cache=True, nogil=True)
def causal_blocks(t, n_head, n_kv, start, window, n_threads):
    """(parts, step, n_pos) of attend_causal: n_kv * parts blocks of up to step query rows over n_pos keys."""
    rows = (n_head // n_kv) * t
    n_pos = start + t - first_key(start, window)
    parts = max(n_threads, (rows * n_pos + _MAX_BLOCK_SCORES - 1) // _MAX_BLOCK_SCORES)
    return parts, (rows + parts - 1) // parts, n_pos


@njit(inline="always", cache=True, nogil=True)
def _block_floats(step, n_pos, hd):
    """Floats of one thread's block buffers: queries and outputs (step, hd), keys and values (n_pos, hd), scores
    (step, n_pos), sums (step,)."""
    return 2 * step * hd + 2 * n_pos * hd + step * n_pos + step


@njit(cache=True, nogil=True)
def causal_work_size(t, n_head, n_kv, hd, start, window, n_threads):
    """Floats of attend_causal's `work`: each thread's block buffers."""
    _, step, n_pos = causal_blocks(t, n_head, n_kv, start, window, n_threads)
    return n_threads * _block_floats(step, n_pos, hd)


@njit(parallel=True, cache=True, nogil=True)
def attend_causal(sgemm_fn, q, kc, vc, start, scale, window, softcap, n_threads, work, out):
    """t queries at positions start.., each over the cached keys it sees (first_key(pos, window)..pos).

    q (t, n_head, hd) float32; kc, vc (n_kv, cache_rows, width) cached rows as attend_one's, position p in row
    p % cache_rows, holding every position the queries see -> out (t, n_head·hd). The heads sharing a kv head
    make rows r = g·t + i (head g of the group, query i); a parallel item is a block of one kv head's rows
    (n_threads blocks per head, so that any number of kv heads shares evenly): its keys and values in float32,
    in position order, scores = Q Kᵀ and out = P V by sgemm (at address sgemm_fn), the causal softmax between.
    work: float32 (>= causal_work_size(...),), the blocks' buffers, one set per thread: reused from pass to
    pass, their pages are faulted in once, not in every block.
    """
    t, n_head, hd = q.shape
    n_kv, cache_rows = kc.shape[0], kc.shape[1]
    group = n_head // n_kv
    rows = group * t
    lo = first_key(start, window)  # the oldest key any of these queries sees
    parts, step, n_pos = causal_blocks(t, n_head, n_kv, start, window, n_threads)
    per_thread = _block_floats(step, n_pos, hd)
    for item in prange(n_kv * parts):
        kv = item // parts
        r0 = (item % parts) * step
        r1 = min(rows, r0 + step)
        if r1 <= r0:
            continue
        m = r1 - r0
        w0 = get_thread_id() * per_thread
        w = work[w0 : w0 + per_thread]
        a = w[: m * hd].reshape(m, hd)  # (m, hd) this block's queries
        w = w[step * hd :]
        keys = w[: n_pos * hd].reshape(n_pos, hd)  # (n_pos, hd)
        values = w[n_pos * hd : 2 * n_pos * hd].reshape(n_pos, hd)
        w = w[2 * n_pos * hd :]
        scores = w[: m * n_pos].reshape(m, n_pos)  # (m, n_pos)
        w = w[step * n_pos :]
        inv_total = w[:m]
        o = w[step : step + m * hd].reshape(m, hd)  # (m, hd)
        for r in range(r0, r1):
            a[r - r0] = q[r % t, kv * group + r // t]
        for p in range(n_pos):
            row = (lo + p) % cache_rows
            cache_row_floats(kc[kv, row], keys[p])
            cache_row_floats(vc[kv, row], values[p])
        sgemm(sgemm_fn, True, m, n_pos, hd, a, hd, keys, hd, scores, n_pos)
        causal_exp(scores, r0, t, start, lo, scale, window, softcap, inv_total)
        sgemm(sgemm_fn, False, m, hd, n_pos, scores, n_pos, values, hd, o, hd)
        for r in range(r0, r1):
            h = kv * group + r // t
            for j in range(hd):
                out[r % t, h * hd + j] = o[r - r0, j] * inv_total[r - r0]
