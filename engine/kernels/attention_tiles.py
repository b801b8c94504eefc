"""Attention's inner loops over a tile of cached positions, as LLVM vector IR.

One token's attention reads every cached key and value once, and at depth that is most of a token's work (the
1.5B model at 16,000 positions: 458 MB of f16 cache a token, against 1 GB of weights). Written as Numba loops,
each (position, query head) pair was a dot product of its own that ended in a horizontal sum, and each value row
was added into accumulators loaded and stored again for every position: the arithmetic, not the read, set the
pace, and a q8_0 cache (half the bytes) decoded slower than f16. Here a tile of TILE positions, already widened
to float32 (attention.attend_heads widens each cached row once for every query head that reads it), is read by
several query heads at once, each register of it loaded once for all of them:

    tile_scores_H(q, qo, qstep, kt, width, scale, out, oo, ostep)                      H = 1, 2 query heads
        out[oo + h·ostep + r] = scale · q[qo + h·qstep :][:width] · kt[r·width :][:width]   h < H, r < TILE
        LANES dot products side by side (H heads x LANES/H positions), their lanes summed by one transposing
        reduction (2·(LANES-1) shuffles and LANES-1 adds for all of them, not a horizontal sum each)
    tile_values_G(w, wo, wstep, vt, width, acc, ao, astep)                            G = 1, 2, 4 query heads
        acc[ao + g·astep :][:width] += Σ_r w[wo + g·wstep + r] · vt[r·width :][:width]       g < G, over r < TILE
        VALUE_CHUNKS registers of each head's sums held across the tile's positions

Measured on the 1.5B's shape (Zen 4, one thread, 16,000 positions of one kv head and its 6 query heads in L3,
times 28 layers): the scores 24 ms -> 7-8, the values 15.5 -> 6-7, the whole head with its softmax 53 -> 21-25;
both threads over 28 layers' caches from memory, f16 56-58 ms a token -> 38-39, q8_0 86-92 -> 32-33.

q, kt, vt, out, w and acc are flat float32 arrays; offsets and widths count float32 values, and width is a
multiple of ROW_STEP (the caller pads rows with zeros). TILE = LANES: one register of float32 a tile of scores,
16 with AVX-512's registers, 8 with AVX2's. Every addition's order is fixed by TILE and width alone (the same
for H or G heads at once), so a head's results do not depend on which other heads or threads share the call.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..cache_types import Q8_BLOCK, Q8_BYTES
from ..formats.emit import F32, I8, I16, I32, I64, halves_to_floats, splat_const, vt
from .simd import KERNELS

LANES = KERNELS.vector_bytes // 4  # float32 values in one register
TILE = LANES  # cached positions a tile: one register of scores


def _pointers(context, builder, signature, args) -> list:
    """Each array argument as its data pointer, the others (intp offsets, a float32) as they are."""
    arrays = (context.make_array(ty) if isinstance(ty, types.Array) else None for ty in signature.args)
    return [a if make is None else make(context, builder, a).data for make, a in zip(arrays, args, strict=True)]


def _load(b: ir.IRBuilder, ptr, off):
    """<LANES x float> at ptr[off]."""
    return b.load(b.bitcast(b.gep(ptr, [off]), vt(F32, LANES).as_pointer()), align=4)


def _store(b: ir.IRBuilder, ptr, off, v) -> None:
    b.store(v, b.bitcast(b.gep(ptr, [off]), v.type.as_pointer()), align=4)


def _splat(b: ir.IRBuilder, x, n: int = LANES):
    """<n x float> of the float x."""
    v = b.insert_element(ir.Constant(vt(F32, n), ir.Undefined), x, ir.Constant(I32, 0))
    return b.shuffle_vector(v, ir.Constant(vt(F32, n), ir.Undefined), ir.Constant(vt(I32, n), [0] * n))


def _fmuladd(b: ir.IRBuilder, x, y, acc):
    """x·y + acc, fused where the CPU has FMA (llvm.fmuladd)."""
    name = f"llvm.fmuladd.v{LANES}f32"
    fn = b.module.globals.get(name) or ir.Function(b.module, ir.FunctionType(x.type, [x.type] * 3), name)
    return b.call(fn, [x, y, acc])


def _lane_sums(b: ir.IRBuilder, vecs: list) -> ir.Value:
    """LANES vectors -> one vector whose lane r is the sum of vecs[r]'s lanes.

    Pairs of vectors fold into one at each step: the low and high halves of every segment of both, side by side,
    added, so that each vector carries twice the rows in segments half as wide; after log2(LANES) steps every
    segment is one lane, and a last shuffle puts row r in lane r.
    """
    n = LANES
    items = [(v, [r]) for r, v in enumerate(vecs)]  # (vector, the row each of its segments sums)
    width = n  # lanes per segment
    while len(items) > 1:
        half = width // 2
        folded = []
        for (x, rows_x), (y, rows_y) in zip(items[0::2], items[1::2], strict=True):
            low, high, rows = [], [], []
            for j in range(len(rows_x)):
                s = j * width
                low += [*range(s, s + half), *range(n + s, n + s + half)]
                high += [*range(s + half, s + width), *range(n + s + half, n + s + width)]
                rows += [rows_x[j], rows_y[j]]
            lo = b.shuffle_vector(x, y, ir.Constant(vt(I32, n), low))
            hi = b.shuffle_vector(x, y, ir.Constant(vt(I32, n), high))
            folded.append((b.fadd(lo, hi), rows))
        items, width = folded, half
    v, rows = items[0]
    order = [rows.index(r) for r in range(n)]
    return b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(vt(I32, n), order))


def _scores_kernel(heads: int):
    """tile_scores for `heads` query heads at once (LANES / heads positions a pass, `heads` passes a tile)."""
    per = LANES // heads  # positions a pass: heads x per accumulators, one register of scores

    def codegen(context, builder, signature, args):
        b = builder
        q_, qo_, qstep_, kt_, width_, scale_, out_, oo_, ostep_ = _pointers(context, b, signature, args)
        zero = splat_const(F32, LANES, 0.0)
        q_at = [b.add(qo_, b.mul(qstep_, ir.Constant(I64, h))) for h in range(heads)]
        out_at = [b.add(oo_, b.mul(ostep_, ir.Constant(I64, h))) for h in range(heads)]
        n_chunks = b.udiv(width_, ir.Constant(I64, LANES))
        for first in range(0, TILE, per):
            accs = [cgutils.alloca_once_value(b, zero) for _ in range(heads * per)]  # registers, once promoted
            starts = [b.mul(width_, ir.Constant(I64, first + p)) for p in range(per)]  # row first+p's offset
            with cgutils.for_range(b, n_chunks) as loop:
                c = b.mul(loop.index, ir.Constant(I64, LANES))
                qv = [_load(b, q_, b.add(q_at[h], c)) for h in range(heads)]
                for p in range(per):
                    kv = _load(b, kt_, b.add(starts[p], c))
                    for h in range(heads):
                        acc = accs[h * per + p]
                        b.store(_fmuladd(b, qv[h], kv, b.load(acc)), acc)
            sums = b.fmul(_lane_sums(b, [b.load(a) for a in accs]), _splat(b, scale_))  # lane h·per + p
            for h in range(heads):
                part = b.shuffle_vector(
                    sums,
                    ir.Constant(sums.type, ir.Undefined),
                    ir.Constant(vt(I32, per), list(range(h * per, (h + 1) * per))),
                )
                _store(b, out_, b.add(out_at[h], ir.Constant(I64, first)), part)
        return context.get_dummy_value()

    def kernel(typingctx, q, qo, qstep, kt, width, scale, out, oo, ostep):
        intp = types.intp
        return types.void(q, intp, intp, kt, intp, types.float32, out, intp, intp), codegen

    kernel.__name__ = kernel.__qualname__ = f"tile_scores_{heads}"
    kernel.__doc__ = f"""tile_scores for {heads} query head(s): head h's query at q[qo + h·qstep], its scores at
    out[oo + h·ostep]."""
    return intrinsic(kernel)


VALUE_CHUNKS = 4  # registers of each head's output held in registers across a tile's positions
ROW_STEP = VALUE_CHUNKS * LANES  # a tile row's width is a multiple of this (tile_values' step)
WIDE_VALUES = LANES == 16  # 4 heads' values at once: 16 of AVX-512's 32 registers hold their sums; AVX2's 16 not


def _values_kernel(heads: int):
    """tile_values for `heads` query heads at once: every value register loaded once for all of them."""
    step = VALUE_CHUNKS * LANES

    def codegen(context, builder, signature, args):
        b = builder
        w_, wo_, wstep_, v_, width_, acc_, ao_, astep_ = _pointers(context, b, signature, args)
        w_at = [b.add(wo_, b.mul(wstep_, ir.Constant(I64, h))) for h in range(heads)]
        acc_at = [b.add(ao_, b.mul(astep_, ir.Constant(I64, h))) for h in range(heads)]
        starts = [b.mul(width_, ir.Constant(I64, r)) for r in range(TILE)]
        with cgutils.for_range(b, b.udiv(width_, ir.Constant(I64, step))) as loop:
            c0 = b.mul(loop.index, ir.Constant(I64, step))
            cs = [b.add(c0, ir.Constant(I64, j * LANES)) for j in range(VALUE_CHUNKS)]
            accs = [[_load(b, acc_, b.add(acc_at[h], c)) for c in cs] for h in range(heads)]
            for r in range(TILE):
                vs = [_load(b, v_, b.add(starts[r], c)) for c in cs]
                for h in range(heads):
                    # loaded here, not hoisted out of the loop: the stores to acc may alias w as LLVM sees it
                    weight = _splat(b, b.load(b.gep(w_, [b.add(w_at[h], ir.Constant(I64, r))])))
                    accs[h] = [_fmuladd(b, weight, v, a) for v, a in zip(vs, accs[h], strict=True)]
            for h in range(heads):
                for c, a in zip(cs, accs[h], strict=True):
                    _store(b, acc_, b.add(acc_at[h], c), a)
        return context.get_dummy_value()

    def kernel(typingctx, w, wo, wstep, vt_, width, acc, ao, astep):
        intp = types.intp
        return types.void(w, intp, intp, vt_, intp, acc, intp, intp), codegen

    kernel.__name__ = kernel.__qualname__ = f"tile_values_{heads}"
    kernel.__doc__ = f"""tile_values for {heads} query head(s): head h's weights at w[wo + h·wstep], its output
    at acc[ao + h·astep]."""
    return intrinsic(kernel)


tile_scores_1, tile_scores_2 = _scores_kernel(1), _scores_kernel(2)
tile_values_1, tile_values_2, tile_values_4 = _values_kernel(1), _values_kernel(2), _values_kernel(4)


# Cached rows widened to float32 in registers: Numba's loops widened a q8_0 row at 3x an f16 row's cost, which
# left the q8_0 cache slower than f16 at depth though it reads half the bytes.
HALVES_STEP = LANES  # half floats widened a step (`widen_halves`)


@intrinsic
def widen_halves(typingctx, row, n, out):
    """out[:n'] = row[:n'] (uint16 half-float bit patterns) as float32, n' = n rounded down to a multiple of
    HALVES_STEP (the caller widens the rest)."""

    def codegen(context, builder, signature, args):
        b = builder
        row_, n_, out_ = _pointers(context, b, signature, args)
        step = ir.Constant(I64, HALVES_STEP)
        with cgutils.for_range(b, b.udiv(n_, step)) as loop:
            at = b.mul(loop.index, step)
            h = b.load(b.bitcast(b.gep(row_, [at]), vt(I16, HALVES_STEP).as_pointer()), align=2)
            _store(b, out_, at, halves_to_floats(b, h, KERNELS.f16c))
        return context.get_dummy_value()

    return types.void(row, types.intp, out), codegen


@intrinsic
def widen_q8_0(typingctx, row, n_blocks, out):
    """out[:32·n_blocks] = the q8_0 blocks of row (uint8: d (half) | qs[32] (int8) each) as float32, d · qs."""

    def codegen(context, builder, signature, args):
        b = builder
        row_, n_blocks_, out_ = _pointers(context, b, signature, args)
        with cgutils.for_range(b, n_blocks_) as loop:
            o = b.mul(loop.index, ir.Constant(I64, Q8_BYTES))
            h = b.load(b.bitcast(b.gep(row_, [o]), vt(I16, 1).as_pointer()), align=1)
            d = b.extract_element(halves_to_floats(b, h, KERNELS.f16c), ir.Constant(I32, 0))
            qs = b.load(b.bitcast(b.gep(row_, [b.add(o, ir.Constant(I64, 2))]), vt(I8, Q8_BLOCK).as_pointer()), align=1)
            values = b.sitofp(b.sext(qs, vt(I32, Q8_BLOCK)), vt(F32, Q8_BLOCK))
            _store(b, out_, b.mul(loop.index, ir.Constant(I64, Q8_BLOCK)), b.fmul(_splat(b, d, Q8_BLOCK), values))
        return context.get_dummy_value()

    return types.void(row, types.intp, out), codegen
