"""Weights repacked for decode: ROWS consecutive rows interleaved, so the inner loops run across rows.

A GGUF row stores its blocks back to back, so a per-row dot reduces 16-32 products per block horizontally,
which Numba compiles poorly (measured on Zen 5: ~2 GB/s). Here W (d, n) is regrouped once, at first use, into

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
`group_flat` (one token) and `group_tile_flat` (simd.TILE tokens sharing each decode of the weights: prefill),
one thread's share of the row groups per call (`group_simd` and `group_simd_tile` run one group alone);
`matvec_reference` runs the same arithmetic as plain loops (each format's `group`): the readable statement of
each format, against which the tests check simd.py.

What each format's q bytes and s fields hold (its `Packing`: byte copies, 16-bit fields, and a repack of the
fields that are not plain copies) is in its module, engine/formats/<type>.py; the dispatch over the formats here
is generated from the registry.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..formats import QUANTIZED
from ..formats.dispatch import by_format
from ..formats.fields import ROWS, h2f, qbyte  # noqa: F401  (h2f: tests call packed.h2f)
from . import cpu, simd
from .attention import int_bits_as_float

TILE = simd.TILE  # tokens per call of a multi-token block kernel (prefill)
PER_ITEM = 16  # tokens per parallel item of a prompt's `matmul`: a multiple of TILE
# Up to this many tokens (a speculative verification pass) are one item per group, TILE at a time: the first
# tile streams the group from memory while it computes, and the rest find it in cache. Over Qwen2.5-1.5B's FFN
# matrices (715 MB; Intel Xeon, 2 threads, fastest of 18) one token took 23.7 ms and a tile of 4 tokens 32.9,
# where leading with one token through the one-token kernel (as this did before; measured the faster on a Zen 5
# with older prefetching) took 44.4; 8 tokens 53.6 against 67.6, 17 tokens 96.0 against 108.3. Under TILE
# tokens, kernels.matmul pads the pass to one tile: 3 tokens 30.9 ms against 39.4 as one-token kernels.
SHORT_MAX = PER_ITEM + 1

# code: (QB quant bytes, byte copies (raw offset, q offset, count), raw offsets of the 16-bit fields)
LAYOUT = {f.code: (f.packing.quant_bytes, f.packing.copies, f.packing.halves) for f in QUANTIZED.values()}
PACKED_CODES = frozenset(LAYOUT)
# by type id: whether this CPU's kernels for the format read byte pairs, and so prompts' xq2 (`double_pairs`)
PAIRED = np.array([c in LAYOUT and c not in simd.KERNELS.quad_codes for c in range(max(LAYOUT) + 1)])


def layout(code: int) -> tuple[int, int]:
    """(L rows per register, W bytes of a row side by side) of format `code`'s packed q on this CPU."""
    return simd.KERNELS.layout(code)


def layout_tables(code: int) -> tuple[int, np.ndarray, np.ndarray]:
    qb, copies, halves = LAYOUT[code]
    return qb, np.array(copies, dtype=np.int64).reshape(-1, 3), np.array(halves, dtype=np.int64)


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
    """quantize_x, into given arrays.

    max|x| is taken over the bit patterns with the sign cleared, ordered as the floats, with inf and nan above
    every finite value, and rint rounds half to even as np.round does: an integer max that vectorizes, where
    a float one with a finiteness test did not (SmolLM2's 256 x 576 prompt rows, 2 threads: 92 -> 45 µs).
    Each loop runs over a block's slice, to the slice's length: a loop of a constant 32 is unrolled whole before
    the loop vectorizer sees it, and the unrolled conversions stayed scalar (8,960 values: 8.5 -> 5.0 µs).
    """
    bits = x.view(np.int32)
    for b in range(x.shape[0] // 32):
        xb = x[b * 32 : b * 32 + 32]
        bb = bits[b * 32 : b * 32 + 32]
        qb = xq[b]
        m = np.int32(0)
        for j in range(bb.shape[0]):
            m = max(m, np.int32(bb[j] & np.int32(0x7FFFFFFF)))
        # a nan or inf in x poisons its block
        d = int_bits_as_float(m) / np.float32(127.0) if m < np.int32(0x7F800000) else np.float32(np.nan)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        for j in range(xb.shape[0]):
            qb[j] = np.int8(np.int32(np.rint(xb[j] * inv)))  # |xb·inv| <= 127
        for h in range(2):
            qh = qb[h * 16 : h * 16 + 16]
            t = np.int32(0)
            for j in range(qh.shape[0]):
                t += np.int32(qh[j])
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


# ---- one group of ROWS rows ----------------------------------------------------------------------------
# The group functions are compiled once and called (not inlined) by every driver below, so that their large
# bodies are not compiled again for each driver and for each parallel one's outlined loop. They read flat views of
# the weight and the activations, which a driver takes once per product (`flat_weight`, `flat_x`,
# `flat_tokens`): a reshape in every call (a C call and reference counts per array) cost ~0.2 µs a group, 10-12 %
# of a one-token product over 1536 columns (Zen 4, the group loop alone, weights in L2).

_group_loops = by_format({f.code: f.group for f in QUANTIZED.values()}, "q, s, g, xq, dx, xsum, acc")


@njit(inline="always", nogil=True)
def flat_weight(q, s):
    """Packed (q, s) -> (qf, sf, nb, qstep, sstep): both flat, nb blocks per row, and a group's bytes of q and
    halves of s per block."""
    qstep = q.shape[2] * q.shape[3] * q.shape[4] * q.shape[5]
    return q.reshape(-1), s.reshape(-1), q.shape[1], qstep, s.shape[2] * ROWS


@njit(inline="always", nogil=True)
def flat_x(xq, dx, xsum):
    """One token's quantize_x output -> (xq, dx, xsum) flat."""
    return xq.reshape(-1), dx, xsum.reshape(-1)


@njit(inline="always", nogil=True)
def flat_tokens(xq, xq2, dx, xsum):
    """A pass's `row_buffers` -> (xq, xq2, dx, xsum) flat, and nx: 32-blocks per token."""
    return xq.reshape(-1), xq2.reshape(-1), dx.reshape(-1), xsum.reshape(-1), dx.shape[1]


@njit(cache=True, nogil=True)
def group_reference(q, s, fmt, g, xq, dx, xsum, acc):
    """acc (ROWS,) = W[g*ROWS : (g+1)*ROWS] @ x̂ for the packed weight (q, s) of the format tagged fmt, as loops."""
    acc[:] = 0
    _group_loops(fmt, q, s, g, xq, dx, xsum, acc)


@njit(cache=True, nogil=True)
def group_flat(w, fmt, g, x, acc):
    """acc (ROWS,) = W[g*ROWS : (g+1)*ROWS] @ x̂ for the packed weight w = flat_weight(q, s) of the format tagged
    fmt and x = flat_x(...), with simd.py's block kernels."""
    qf, sf, nb, qstep, sstep = w
    xf, dx, xsf = x
    acc[:] = 0
    simd.BLOCKS(fmt, qf, g * nb * qstep, qstep, sf, g * nb * sstep, sstep, xf, dx, xsf, nb, acc)


@njit(cache=True, nogil=True)
def group_tile_flat(w, fmt, g, xs, i0, acc):
    """acc (TILE * ROWS,), token i's row at (i - i0) * ROWS = W[g*ROWS : (g+1)*ROWS] @ x̂_i for the TILE tokens
    i0 <= i < i0 + TILE (prefill), of w = flat_weight(q, s) and xs = flat_tokens(...) (see group_simd_tile)."""
    qf, sf, nb, qstep, sstep = w
    xf, xf2, dxf, xsf, nx = xs
    acc[:] = 0
    n = nx * 32  # values per token
    simd.BLOCKS_TILE(fmt, qf, g * nb * qstep, qstep, sf, g * nb * sstep, sstep, xf, xf2, i0 * n, n, dxf, xsf,
                     i0 * nx, nx, acc, nb)  # fmt: skip


@njit(cache=True, nogil=True)
def group_simd(q, s, fmt, g, xq, dx, xsum, acc):
    """acc (ROWS,) = W[g*ROWS : (g+1)*ROWS] @ x̂ for the packed weight (q, s), with simd.py's block kernels."""
    group_flat(flat_weight(q, s), fmt, g, flat_x(xq, dx, xsum), acc)


@njit(cache=True, nogil=True)
def group_simd_tile(q, s, fmt, g, xq, xq2, dx, xsum, i0, acc):
    """acc (TILE, ROWS) = W[g*ROWS : (g+1)*ROWS] @ x̂_i for the TILE tokens i0 <= i < i0 + TILE (prefill).

    xq (t, n/32, 32), dx (t, n/32), xsum (t, n/32, 2) as from quantize_x; xq2 (t, n/32, 64): every token's
    xq with each byte pair written twice (`double_pairs`), which the pair kernels read. The tile kernels decode
    each block's bytes once for all TILE tokens; each token's result is group_simd's for that token, bit for
    bit.
    """
    group_tile_flat(flat_weight(q, s), fmt, g, flat_tokens(xq, xq2, dx, xsum), i0, acc.reshape(-1))


@njit(inline="always", nogil=True)
def group_into(w, fmt, g, x, out):
    """out[g*ROWS : (g+1)*ROWS] = group g's rows of W @ x̂ (`group_flat`), as many of them as out holds: the
    kernels write into out itself, the last group's few rows by way of a buffer."""
    r0 = g * ROWS
    if r0 + ROWS <= out.shape[0]:
        group_flat(w, fmt, g, x, out[r0 : r0 + ROWS])
    else:
        acc = np.empty(ROWS, dtype=np.float32)
        group_flat(w, fmt, g, x, acc)
        out[r0:] = acc[: out.shape[0] - r0]


# ---- drivers --------------------------------------------------------------------------------------------
# A parallel driver hands each thread one contiguous share of its items (row groups), as prange's static schedule
# did item by item, and the share runs in one call that takes the flat views once (`groups_into`, `tiles_into`).


@intrinsic
def thread_count(typingctx):
    """numba.get_num_threads() in compiled code, as the threading layer's own symbol: Numba's version calls it
    through a ctypes pointer, which keeps every function that uses it out of the kernel cache. For parallel
    functions, whose reload from the cache starts the threading layer that defines the symbol."""
    numba.get_num_threads()  # starts the threading layer here too

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(cgutils.intp_t, []), "get_num_threads")
        return builder.call(fn, [])

    return types.intp(), codegen


@njit(inline="always", nogil=True)
def share(p, parts, n):
    """Part p's share of n items split into `parts` contiguous runs: (start, end)."""
    return p * n // parts, (p + 1) * n // parts


@njit(cache=True, nogil=True)
def groups_into(q, s, fmt, xq, dx, xsum, g0, g1, out):
    """out's rows of the groups g0 <= g < g1 of W @ x̂, x quantized (xq, dx, xsum as quantize_x returns them)."""
    w, x = flat_weight(q, s), flat_x(xq, dx, xsum)
    for g in range(g0, g1):
        group_into(w, fmt, g, x, out)


@njit(cache=True, nogil=True)
def matvec(q, s, fmt, x, out):
    """W (d, n) @ x̂ (n,) -> out (d,): x quantized per 32 to int8, the row groups shared among the threads."""
    xq, dx, xsum = quantize_x(x)
    matvec_quantized(q, s, fmt, xq, dx, xsum, out)


@njit(parallel=True, cache=True, nogil=True)
def matvec_quantized(q, s, fmt, xq, dx, xsum, out):
    """`matvec` of an x already quantized (xq, dx, xsum as quantize_x returns them)."""
    parts = thread_count()
    for p in prange(parts):
        g0, g1 = share(p, parts, q.shape[0])
        groups_into(q, s, fmt, xq, dx, xsum, g0, g1, out)


@njit(cache=True, nogil=True)
def matvec_serial(q, s, fmt, x, out):
    """`matvec` on the calling thread alone: for weights too small to repay a parallel launch."""
    xq, dx, xsum = quantize_x(x)
    matvec_quantized_serial(q, s, fmt, xq, dx, xsum, out)


@njit(cache=True, nogil=True)
def matvec_quantized_serial(q, s, fmt, xq, dx, xsum, out):
    """`matvec_quantized` on the calling thread alone."""
    groups_into(q, s, fmt, xq, dx, xsum, 0, q.shape[0], out)


@njit(parallel=True, cache=True, nogil=True)
def matvec_reference(q, s, fmt, x, out):
    """`matvec` with the plain-loop kernels (group_*): the same arithmetic, for checking simd.py."""
    xq, dx, xsum = quantize_x(x)
    d = out.shape[0]
    for g in prange(q.shape[0]):
        acc = np.empty(ROWS, dtype=np.float32)
        group_reference(q, s, fmt, g, xq, dx, xsum, acc)
        for r in range(min(ROWS, d - g * ROWS)):
            out[g * ROWS + r] = acc[r]


def row_buffers(
    t: int, n: int, take=None, paired: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`matmul`'s buffers for t rows of n values: xq int8 (t', n/32, 32), dx float32 (t', n/32), xsum int32
    (t', n/32, 2), xq2 int8 (t', n/32, 64), t' = t but TILE for a pass of 2 to TILE - 1 rows (padded to one
    tile); from take(name, shape, dtype) (a Scratch's) where given. Without `paired` (a format whose kernels
    read quads: they never read xq2), xq2 is empty: 64 bytes a value fewer (4.6 MB for 256 rows of 8960
    values, the 1.5B's FFN-down input)."""
    take = take or (lambda _name, shape, dtype: np.empty(shape, dtype=dtype))
    nb = n // 32
    t = TILE if 1 < t < TILE else t
    xq2 = take("xq2", (t, nb, 64), np.int8) if paired else np.empty((0, nb, 64), dtype=np.int8)
    return take("xq", (t, nb, 32), np.int8), take("dx", (t, nb), np.float32), take("xsum", (t, nb, 2), np.int32), xq2


def matmul(q, s, fmt, xs, out, xq, dx, xsum, xq2, quantized: bool) -> None:
    """xs (t, n) @ W.T -> out (t, d) with every token's x quantized as in `matvec` (prefill), into the caller's
    buffers xq, dx, xsum, xq2 (`row_buffers`); with `quantized`, xq, dx and xsum hold xs's already (a
    product of the same input before this one filled them).

    Two launches: the rows quantized (`quantize_rows`, one compiled loop for every format), then the products
    (`matmul_quantized`, compiled per format). Numba compiles a parallel loop's body twice, into its function
    and into a gufunc: one loop fewer in each format's driver took a third off its compile time (the avx2 set's
    13 formats, 93 -> 66 s on one core). Each token's row of out equals `matvec` of it, bit for bit.
    """
    paired = xq2.shape[0] > 0  # the format's kernels read pairs (else `row_buffers` left xq2 empty)
    if paired or not quantized:
        quantize_rows(xs, xq, dx, xsum, xq2, quantized)
    matmul_quantized(q, s, fmt, xs.shape[0], out, xq, dx, xsum, xq2)


@njit(parallel=True, cache=True, nogil=True)
def quantize_rows(xs, xq, dx, xsum, xq2, quantized):
    """`matmul`'s input: xs's rows quantized into xq, dx, xsum (unless `quantized`: there already), the rows
    past xs (a pass of under TILE tokens padded to one tile) zeros, and where xq2 is not empty each row's
    byte pairs doubled into it (`double_pairs`)."""
    t = xs.shape[0]
    paired = xq2.shape[0] > 0
    for i in prange(xq.shape[0]):
        if not quantized and i < t:
            quantize_into(xs[i], xq[i], dx[i], xsum[i])
        elif not quantized:  # padding: zeros, whose results are dropped
            xq[i] = 0
            dx[i] = 0
            xsum[i] = 0
        if paired:  # the quad kernels never read xq2
            double_pairs(xq[i], xq2[i])


@njit(parallel=True, cache=True, nogil=True)
def matmul_quantized(q, s, fmt, t, out, xq, dx, xsum, xq2):
    """`matmul`'s products of t quantized rows: out (t, d).

    An item is one row group for several tokens: its weights come from memory once and from cache for the other
    tokens, which run TILE at a time through the tile kernels (decoding the weight bytes once per tile) and the
    last few one by one (a pass of under TILE tokens, whose buffers `row_buffers` padded to one tile, runs as
    that tile). Up to SHORT_MAX tokens form one item per group; more go PER_ITEM to an item.
    """
    per_item = t if t <= SHORT_MAX else PER_ITEM
    n_items = q.shape[0] * ((t + per_item - 1) // per_item)
    parts = thread_count()
    for p in prange(parts):
        i0, i1 = share(p, parts, n_items)
        tiles_into(q, s, fmt, t, per_item, out, xq, dx, xsum, xq2, i0, i1)


@njit(cache=True, nogil=True)
def tiles_into(q, s, fmt, t, per_item, out, xq, dx, xsum, xq2, item0, item1):
    """`matmul_quantized`'s items item0 <= item < item1, in order (group item // n_tok, tokens from
    (item % n_tok) * per_item)."""
    padded = xq.shape[0] > t  # a pass of under TILE tokens, run as one tile (`row_buffers`)
    d = out.shape[1]
    n_tok = (t + per_item - 1) // per_item
    w, xs = flat_weight(q, s), flat_tokens(xq, xq2, dx, xsum)
    acc = np.empty(TILE * ROWS, dtype=np.float32)  # token k of a tile at k * ROWS
    for item in range(item0, item1):
        g = item // n_tok
        t0 = (item % n_tok) * per_item
        t1 = min(t, t0 + per_item)
        rows = min(ROWS, d - g * ROWS)
        i = t0
        while i < t1:
            if t1 - i >= TILE or padded:
                group_tile_flat(w, fmt, g, xs, i, acc)
                done = min(TILE, t1 - i)
            else:  # the last few
                group_flat(w, fmt, g, flat_x(xq[i], dx[i], xsum[i]), acc[:ROWS])
                done = 1
            for k in range(done):
                for r in range(rows):
                    out[i + k, g * ROWS + r] = acc[k * ROWS + r]
            i += done


def shares_of_many(qs, ss, fmts, xq, dx, xsum, outs, starts, a, b):
    """`groups_into` for the items a <= item < b of several weights, weight k's groups the items starts[k] ..
    starts[k + 1] (tuples whose formats may differ: Numba indexes such a tuple with constants only). Compiled
    code only."""
    raise NotImplementedError("packed.shares_of_many runs inside compiled kernels only")


@overload(shares_of_many, inline="always")
def _shares_of_many(qs, ss, fmts, xq, dx, xsum, outs, starts, a, b):
    body = [
        f"    lo, hi = max(a, starts[{k}]) - starts[{k}], min(b, starts[{k + 1}]) - starts[{k}]\n"
        f"    if lo < hi:\n"
        f"        groups_into(qs[{k}], ss[{k}], fmts[{k}], xq, dx, xsum, lo, hi, outs[{k}])"
        for k in range(len(fmts))
    ]
    head = "def impl(qs, ss, fmts, xq, dx, xsum, outs, starts, a, b):\n"
    exec(head + "\n".join(body), scope := {"groups_into": groups_into})
    return scope["impl"]


@njit(parallel=True, cache=True, nogil=True)
def matvec_many(qs, ss, fmts, x, outs):
    """W_i @ x̂ -> outs[i] for several packed weights of the same input, in one parallel launch.

    qs, ss, fmts, outs: tuples of the weights' packed arrays, format tags and outputs (the formats may differ: a
    layer's small k and v, on one thread alone, left the other idle). Their row groups, one after another, are
    shared among the threads.
    """
    xq, dx, xsum = quantize_x(x)
    k = len(qs)
    starts = np.zeros(k + 1, dtype=np.int64)  # weight i's first item
    for i in range(k):
        starts[i + 1] = starts[i] + qs[i].shape[0]
    parts = thread_count()
    for p in prange(parts):
        a, b = share(p, parts, starts[k])
        shares_of_many(qs, ss, fmts, xq, dx, xsum, outs, starts, a, b)


# ---- packing and unpacking ------------------------------------------------------------------------------


@njit(inline="always", nogil=True)
def _copied_only(row, o, q, s, g, b, r):
    """The repack of a format whose fields are all plain copies: nothing to do."""


@njit(inline="always", nogil=True)
def _copied_back(q, s, g, b, r, out, o):
    """Its unpack: nothing either."""


_repack = by_format({f.code: f.packing.repack or _copied_only for f in QUANTIZED.values()}, "row, o, q, s, g, b, r")
_unpack = by_format({f.code: f.packing.unpack or _copied_back for f in QUANTIZED.values()}, "q, s, g, b, r, out, o")


def pack(raw, fmt, block_bytes, copies, halves, q, s):
    """raw uint8 (d, row_bytes), the file's rows of the format tagged fmt -> q, s (zero-initialised by the caller,
    in `layout(code)`).

    The copies move whole words, read in file order, rows becoming innermost (W bytes of a row side by side):
    4-byte words where W, the block size and every copied field allow (Q4_K on VNNI layouts: each word one
    store, a Q4_K expert of 885 KB packed in 0.46 ms where 16-bit words a division apart took 1.1), else 16-bit
    words (every copied field starts at an even offset of an even-sized block). A format of odd-sized blocks
    (MXFP4: 17 bytes) copies nothing. The format's `repack` then fills in the fields that are not plain copies.
    """
    pack_many(raw, fmt, block_bytes, copies, halves, q[None], s[None], np.zeros(1, dtype=np.int64))


def pack_many(raw, fmt, block_bytes, copies, halves, q_all, s_all, which):
    """`pack` of several matrices of d rows stacked in raw (n·d, row_bytes) (a tensor of experts) into q_all
    (n, G, ...), s_all (n, G, ...), matrices `which` only, in one parallel launch."""
    unit = _word_bytes(raw.shape[1], block_bytes, copies, q_all.shape[6])
    words = {4: np.uint32, 2: np.uint16}.get(unit)
    raw_words = raw.view(words) if words else np.zeros((raw.shape[0], 0), dtype=np.uint16)
    unit = unit or 2
    q_words = q_all.view(words or np.uint16).reshape(q_all.shape[0], -1)
    d = raw.shape[0] // q_all.shape[0]
    pack_groups(raw, raw_words, d, fmt, block_bytes, unit, copies // unit, halves, q_all, q_words, s_all, which)


def _word_bytes(row_bytes: int, block_bytes: int, copies: np.ndarray, width: int) -> int:
    """The widest word (4 or 2 bytes; 0 where there is no copy) that every copy moves whole."""
    if not len(copies):
        return 0
    for unit in (4, 2):
        if width % unit == 0 and block_bytes % unit == 0 and row_bytes % unit == 0 and not (copies % unit).any():
            return unit
    raise ValueError(f"copies {copies.tolist()} of {block_bytes}-byte blocks are not in 16-bit words")


@njit(parallel=True, cache=True, nogil=True)
def pack_groups(raw, raw_words, d, fmt, block_bytes, unit, copies, halves, q_all, q_words, s_all, which):
    """`pack_many`'s compiled loop, raw's rows and q as words of `unit` bytes: raw_words (n·d, row_bytes / unit),
    q_words (n, words of a matrix), copies in words. A parallel item is one row group of one matrix."""
    n_groups, nb = q_all.shape[1], q_all.shape[2]
    lanes = q_all.shape[5]
    hw = q_all.shape[6] // unit  # words of a row side by side
    block_words = block_bytes // unit
    words = q_all.shape[4] * hw  # words per block row of one row
    for item in prange(which.shape[0] * n_groups):
        e, g = which[item // n_groups], item % n_groups
        q, s, qw = q_all[e], s_all[e], q_words[e]
        for r in range(min(ROWS, d - g * ROWS)):
            row = raw[e * d + g * ROWS + r]
            src_row = raw_words[e * d + g * ROWS + r]
            c, lane = r // lanes, r % lanes
            for b in range(nb):
                base = ((g * nb + b) * (ROWS // lanes) + c) * words * lanes + lane * hw
                for cp in range(copies.shape[0]):
                    src = b * block_words + copies[cp, 0]
                    # word kk goes to base + (kk // hw)·lanes·hw + kk % hw, kept as a running position: a
                    # division a word cost more than the copy
                    m = copies[cp, 1] % hw
                    dst = base + (copies[cp, 1] // hw) * lanes * hw + m
                    for k in range(copies[cp, 2]):
                        qw[dst] = src_row[src + k]
                        m += 1
                        dst += 1
                        if m == hw:
                            m = 0
                            dst += (lanes - 1) * hw
                for h in range(halves.shape[0]):
                    at = b * block_bytes + halves[h]
                    s[g, b, h, r] = np.uint16(row[at]) | (np.uint16(row[at + 1]) << np.uint16(8))
                _repack(fmt, row, b * block_bytes, q, s, g, b, r)


@njit(inline="always", cache=True, nogil=True)
def unpack_row(q, s, fmt, block_bytes, copies, halves, row, out):
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
            out[o + halves[h]] = np.uint8(v & 255)
            out[o + halves[h] + 1] = np.uint8(v >> 8)
        _unpack(fmt, q, s, g, b, r, out, o)  # the fields the format's repack changed


@njit(cache=True, nogil=True)
def dequantize_row(q, s, fmt, block_bytes, copies, halves, f16, row, buf, out):
    """W[row] -> out (n,) float32, through its file bytes (buf, row_bytes) and blocks.py's dequantizers."""
    unpack_row(q, s, fmt, block_bytes, copies, halves, row, buf)
    cpu.deq_row(fmt, buf, f16, out)


@njit(parallel=True, cache=True, nogil=True)
def dequantize_rows(q, s, fmt, block_bytes, copies, halves, f16, r0, out):
    """W[r0 : r0 + k] (k, n) -> out (k, n) float32."""
    row_bytes = q.shape[1] * block_bytes
    k = out.shape[0]
    n_chunks = min(k, 64)
    for c in prange(n_chunks):
        buf = np.empty(row_bytes, dtype=np.uint8)
        for i in range(c * k // n_chunks, (c + 1) * k // n_chunks):
            dequantize_row(q, s, fmt, block_bytes, copies, halves, f16, r0 + i, buf, out[i])
