"""Block dot products written as LLVM vector IR, called from Numba like functions (`numba.extending.intrinsic`).

Numba's auto-vectorized loops over the packed layout reach ~1 byte of weights per vector instruction: every
nibble is widened to 32 bits and multiplied alone. These kernels keep bytes as bytes and multiply them pairwise
with x86's pmaddubsw (u8 x s8 -> adjacent pairs summed to s16), ~4 bytes per instruction. The packed layout
(packed.py) stores each row's quant bytes in pairs: byte k of a block, for row l of a 16-row chunk, is at
q[g, b, c, k // 2, l, k % 2], so 32 loaded bytes are 16 rows x 2 consecutive bytes, and the activation pair
(x[k], x[k+1]) broadcast to every row's byte pair feeds pmaddubsw directly.

Each intrinsic handles one block of all ROWS rows of a group, 16 rows (one 256-bit register) at a time, and
adds its float32 results to `acc` (ROWS,). Arguments are flat arrays and element offsets computed by the caller:

    q     uint8   flat packed bytes; qo: offset of this block (q[g, b, 0, 0, 0, 0])
    s     uint16  flat packed half-floats; so: offset of s[g, b, 0, 0]
    xq    int8    flat quantized activations; xo: offset of this block's first value
    dx    float32 activation scales per 32; xsum int32 (n/32, 2) flat: sums of xq per 16; xb: first 32-block

Integer sums are exact; the bounds that keep the 16-bit partial sums from saturating are noted at each kernel.
The AVX2 instructions are used when the compile target has AVX2; elsewhere the same arithmetic is emitted as
plain vector IR (exact too, slower).
"""

from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from .cpu import Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0

ROWS = 64  # rows per group (packed.ROWS)
LANES = 16  # rows per register: 32 bytes = 16 rows x 2 bytes
CHUNKS = ROWS // LANES

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()


def _target_has(feature: str) -> bool:
    try:
        return f"+{feature}" in cpu_target.target_context.codegen()._tm_features
    except AttributeError:  # a Numba without the private attribute: stay portable
        return False


HAVE_AVX2 = _target_has("avx2")


def _vt(elt: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elt, n)


def _splat_const(elt: ir.Type, n: int, value) -> ir.Constant:
    return ir.Constant(_vt(elt, n), [value] * n)


class _Emitter:
    """Small helpers over an IRBuilder, for the kernels below."""

    def __init__(self, context, builder, signature, args, qb: int):
        self.b = builder
        self.chunk_bytes = qb * LANES  # bytes of one 16-row chunk of a block
        self.vals = []
        for ty, a in zip(signature.args, args, strict=True):
            if isinstance(ty, types.Array):
                self.vals.append(context.make_array(ty)(context, builder, a).data)
            elif isinstance(ty, types.Integer) and ty.bitwidth != 64:
                self.vals.append(builder.sext(a, I64) if ty.signed else builder.zext(a, I64))
            else:
                self.vals.append(a)

    def at(self, base, k: int):
        return self.b.add(base, ir.Constant(I64, k)) if k else base

    @contextmanager
    def chunks(self):
        """Loop over the CHUNKS 16-row slices of the group (a loop, not unrolled: it keeps compiles short)."""
        with cgutils.for_range(self.b, ir.Constant(I64, CHUNKS)) as loop:
            yield loop.index

    def qpair(self, q, qo, c, jp: int):
        """<32 x i8>: byte pair jp of the 16 rows of chunk c (q[g, b, c, jp, :, :])."""
        off = self.b.add(self.at(qo, jp * 2 * LANES), self.b.mul(c, ir.Constant(I64, self.chunk_bytes)))
        return self.load(q, off, I8, 2 * LANES)

    def qpair16(self, q, qo, c, jp: int):
        """The same as 16 little-endian 16-bit words."""
        return self.b.bitcast(self.qpair(q, qo, c, jp), _vt(I16, LANES))

    def rows(self, base, c, k: int = 0):
        """Offset of field k (k * ROWS) of chunk c's rows in an s-like array."""
        return self.b.add(self.at(base, k * ROWS), self.b.mul(c, ir.Constant(I64, LANES)))

    def load(self, ptr, off, elt: ir.Type, n: int):
        p = self.b.bitcast(self.b.gep(ptr, [off]), _vt(elt, n).as_pointer())
        return self.b.load(p, align=1)

    def load_scalar(self, ptr, off):
        return self.b.load(self.b.gep(ptr, [off]))

    def store(self, ptr, off, v):
        p = self.b.bitcast(self.b.gep(ptr, [off]), v.type.as_pointer())
        self.b.store(v, p, align=1)

    def splat(self, scalar, n: int):
        t = _vt(scalar.type, n)
        v = self.b.insert_element(ir.Constant(t, ir.Undefined), scalar, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(t, ir.Undefined), ir.Constant(_vt(I32, n), [0] * n))

    def shuffle(self, v, idx: list[int]):
        return self.b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(_vt(I32, len(idx)), idx))

    def concat(self, a, c):
        n = a.type.count
        return self.b.shuffle_vector(a, c, ir.Constant(_vt(I32, 2 * n), list(range(2 * n))))

    def pair(self, xq, off):
        """The bytes (xq[off], xq[off + 1]) repeated for 16 rows: <32 x i8>."""
        p = self.b.bitcast(self.b.gep(xq, [off]), I16.as_pointer())
        return self.b.bitcast(self.splat(self.b.load(p, align=1), LANES), _vt(I8, 2 * LANES))

    def nibbles(self, v, high: bool):
        """Low or high nibble of every byte of v <32 x i8>."""
        if high:  # no byte shift on x86: shift the 16-bit lanes, then mask
            v = self.b.bitcast(self.b.lshr(self.b.bitcast(v, _vt(I16, LANES)), _splat_const(I16, LANES, 4)), v.type)
        return self.b.and_(v, _splat_const(I8, 2 * LANES, 15))

    def bits16(self, h, shift: int, mask: int):
        """(h << shift) & mask per 16-bit lane for shift >= 0, (h >> -shift) & mask otherwise; as <32 x i8>."""
        if shift > 0:
            h = self.b.shl(h, _splat_const(I16, LANES, shift))
        elif shift < 0:
            h = self.b.lshr(h, _splat_const(I16, LANES, -shift))
        return self.b.bitcast(self.b.and_(h, _splat_const(I16, LANES, mask)), _vt(I8, 2 * LANES))

    def maddubs(self, a, x):
        """<32 x i8> unsigned a, signed x -> <16 x i16>: a[2i]x[2i] + a[2i+1]x[2i+1], saturated (pmaddubsw)."""
        if HAVE_AVX2:
            fnty = ir.FunctionType(_vt(I16, LANES), [_vt(I8, 2 * LANES)] * 2)
            fn = self.b.module.globals.get("llvm.x86.avx2.pmadd.ub.sw")
            if fn is None:
                fn = ir.Function(self.b.module, fnty, "llvm.x86.avx2.pmadd.ub.sw")
            return self.b.call(fn, [a, x])
        t32 = _vt(I32, LANES)
        even, odd = list(range(0, 2 * LANES, 2)), list(range(1, 2 * LANES, 2))
        p = self.b.add(
            self.b.mul(self.b.zext(self.shuffle(a, even), t32), self.b.sext(self.shuffle(x, even), t32)),
            self.b.mul(self.b.zext(self.shuffle(a, odd), t32), self.b.sext(self.shuffle(x, odd), t32)),
        )
        lo, hi = _splat_const(I32, LANES, -32768), _splat_const(I32, LANES, 32767)
        p = self.b.select(self.b.icmp_signed(">", p, lo), p, lo)
        p = self.b.select(self.b.icmp_signed("<", p, hi), p, hi)
        return self.b.trunc(p, _vt(I16, LANES))

    def pmaddwd(self, a, x):
        """<16 x i16> a, x -> <8 x i32>: a[2i]x[2i] + a[2i+1]x[2i+1] (pmaddwd; cannot overflow)."""
        if HAVE_AVX2:
            fnty = ir.FunctionType(_vt(I32, 8), [_vt(I16, 16)] * 2)
            fn = self.b.module.globals.get("llvm.x86.avx2.pmadd.wd")
            if fn is None:
                fn = ir.Function(self.b.module, fnty, "llvm.x86.avx2.pmadd.wd")
            return self.b.call(fn, [a, x])
        t32 = _vt(I32, 8)
        even, odd = list(range(0, 16, 2)), list(range(1, 16, 2))
        return self.b.add(
            self.b.mul(self.b.sext(self.shuffle(a, even), t32), self.b.sext(self.shuffle(x, even), t32)),
            self.b.mul(self.b.sext(self.shuffle(a, odd), t32), self.b.sext(self.shuffle(x, odd), t32)),
        )

    def widen(self, v16):
        return self.b.sext(v16, _vt(I32, LANES))

    def even_odd_bytes(self, v):
        """<32 x i8> of 16 rows' byte pairs -> (first bytes, second bytes), each <16 x i8>."""
        return self.shuffle(v, list(range(0, 32, 2))), self.shuffle(v, list(range(1, 32, 2)))

    def halves(self, s, off):
        """16 rows' half-floats at s[off] as <16 x float> (vcvtph2ps with F16C)."""
        return self.b.fpext(self.b.bitcast(self.load(s, off, I16, LANES), _vt(F16, LANES)), _vt(F32, LANES))

    def fsplat(self, f):
        return self.splat(f, LANES)

    def to_float(self, i32v):
        return self.b.sitofp(i32v, _vt(F32, LANES))

    def add_to_acc(self, acc, c, v):
        off = self.b.mul(c, ir.Constant(I64, LANES))
        self.store(acc, off, self.b.fadd(self.load(acc, off, F32, LANES), v))


def _zero16():
    return _splat_const(I16, LANES, 0)


def _zero32():
    return _splat_const(I32, LANES, 0)


def _xsum32(e: _Emitter, xsum, xb):
    """Sum of xq over the 32-block xb (two 16-sums), as i32."""
    i = e.b.mul(xb, ir.Constant(I64, 2))
    return e.b.add(e.load_scalar(xsum, i), e.load_scalar(xsum, e.at(i, 1)))


# ---- Q4_0, Q4_1: 16 bytes, 8 pairs; value = nibble (- 8 for Q4_0) --------------------------------------
# Each pmaddubsw sums 2 products <= 15 * 127; 8 pairs per accumulator: <= 30480, no saturation.


def _q4_sums(e: _Emitter, q, qo, xq, xo, c):
    """Per row of chunk c: sum over the block of nibble * xq, as <16 x i32>."""
    acc_lo, acc_hi = _zero16(), _zero16()
    for jp in range(8):  # byte pair (2jp, 2jp+1): low nibbles are values 2jp.., high ones 16 + 2jp..
        v = e.qpair(q, qo, c, jp)
        acc_lo = e.b.add(acc_lo, e.maddubs(e.nibbles(v, False), e.pair(xq, e.at(xo, 2 * jp))))
        acc_hi = e.b.add(acc_hi, e.maddubs(e.nibbles(v, True), e.pair(xq, e.at(xo, 16 + 2 * jp))))
    return e.b.add(e.widen(acc_lo), e.widen(acc_hi))


def _block_q4(context, builder, signature, args, with_min: bool):
    e = _Emitter(context, builder, signature, args, 16)
    q, qo, s, so, xq, xo, dx, xsum, xb, acc = e.vals
    b = e.b
    d_x = e.fsplat(e.load_scalar(dx, xb))
    total = _xsum32(e, xsum, xb)
    if with_min:  # the min term: m * sum(x̂)
        sx = e.fsplat(b.fmul(e.load_scalar(dx, xb), b.sitofp(total, F32)))
    else:  # every value is nibble - 8
        offset = e.splat(b.mul(total, ir.Constant(I32, 8)), LANES)
    with e.chunks() as c:
        isum = _q4_sums(e, q, qo, xq, xo, c)
        if not with_min:
            isum = b.sub(isum, offset)
        part = b.fmul(e.halves(s, e.rows(so, c)), b.fmul(d_x, e.to_float(isum)))
        if with_min:
            part = b.fadd(part, b.fmul(e.halves(s, e.rows(so, c, 1)), sx))
        e.add_to_acc(acc, c, part)
    return context.get_dummy_value()


def _sig(q, qo, s, so, xq, xo, dx, xsum, xb, acc):
    return types.void(q, qo, s, so, xq, xo, dx, xsum, xb, acc)


@intrinsic
def block_q4_0(typingctx, q, qo, s, so, xq, xo, dx, xsum, xb, acc):
    """acc += W[group] @ x̂ over one Q4_0 block."""
    return _sig(q, qo, s, so, xq, xo, dx, xsum, xb, acc), lambda c, b, sg, a: _block_q4(c, b, sg, a, False)


@intrinsic
def block_q4_1(typingctx, q, qo, s, so, xq, xo, dx, xsum, xb, acc):
    """acc += W[group] @ x̂ over one Q4_1 block."""
    return _sig(q, qo, s, so, xq, xo, dx, xsum, xb, acc), lambda c, b, sg, a: _block_q4(c, b, sg, a, True)


# ---- Q5_0: nibbles plus a fifth bit from s[1] (values 0-15) and s[2] (16-31) ----------------------------
# s[1], s[2] hold qh's bits reordered at packing: low byte = bits of the even values, high byte = odd ones,
# so bit jp of each byte belongs to byte pair jp. Values <= 31: pmaddubsw pairs <= 7874, 4 pairs per 16-bit
# accumulator (<= 31496), then widened.


def _block_q5_0(context, builder, signature, args):
    e = _Emitter(context, builder, signature, args, 16)
    q, qo, s, so, xq, xo, dx, xsum, xb, acc = e.vals
    b = e.b
    d_x = e.fsplat(e.load_scalar(dx, xb))
    offset = e.splat(b.mul(_xsum32(e, xsum, xb), ir.Constant(I32, 16)), LANES)  # every value is v - 16
    with e.chunks() as c:
        h_lo = e.load(s, e.rows(so, c, 1), I16, LANES)
        h_hi = e.load(s, e.rows(so, c, 2), I16, LANES)
        isum = _zero32()
        acc_lo, acc_hi = _zero16(), _zero16()
        for jp in range(8):
            v = e.qpair(q, qo, c, jp)
            lo = b.or_(e.nibbles(v, False), e.bits16(h_lo, 4 - jp, 0x1010))
            hi = b.or_(e.nibbles(v, True), e.bits16(h_hi, 4 - jp, 0x1010))
            acc_lo = b.add(acc_lo, e.maddubs(lo, e.pair(xq, e.at(xo, 2 * jp))))
            acc_hi = b.add(acc_hi, e.maddubs(hi, e.pair(xq, e.at(xo, 16 + 2 * jp))))
            if jp % 4 == 3:
                isum = b.add(isum, b.add(e.widen(acc_lo), e.widen(acc_hi)))
                acc_lo, acc_hi = _zero16(), _zero16()
        isum = b.sub(isum, offset)
        e.add_to_acc(acc, c, b.fmul(e.halves(s, e.rows(so, c)), b.fmul(d_x, e.to_float(isum))))
    return context.get_dummy_value()


@intrinsic
def block_q5_0(typingctx, q, qo, s, so, xq, xo, dx, xsum, xb, acc):
    """acc += W[group] @ x̂ over one Q5_0 block."""
    return _sig(q, qo, s, so, xq, xo, dx, xsum, xb, acc), _block_q5_0


# ---- Q8_0: 32 signed bytes, 16 pairs; pmaddwd on bytes widened to 16 bits ------------------------------


def _block_q8_0(context, builder, signature, args):
    e = _Emitter(context, builder, signature, args, 32)
    q, qo, s, so, xq, xo, dx, xsum, xb, acc = e.vals
    b = e.b
    d_x = e.fsplat(e.load_scalar(dx, xb))
    xpairs = [b.sext(e.pair(xq, e.at(xo, 2 * jp)), _vt(I16, 2 * LANES)) for jp in range(16)]
    xpairs = [e.shuffle(p, list(range(16))) for p in xpairs]  # the pattern repeats: 8 rows' worth is enough
    with e.chunks() as c:
        sums = [_splat_const(I32, 8, 0), _splat_const(I32, 8, 0)]
        for jp in range(16):
            v = b.sext(e.qpair(q, qo, c, jp), _vt(I16, 2 * LANES))
            for h in range(2):  # rows 0-7 and 8-15 of the chunk
                part = e.shuffle(v, list(range(16 * h, 16 * h + 16)))
                sums[h] = b.add(sums[h], e.pmaddwd(part, xpairs[jp]))
        isum = e.concat(sums[0], sums[1])
        e.add_to_acc(acc, c, b.fmul(e.halves(s, e.rows(so, c)), b.fmul(d_x, e.to_float(isum))))
    return context.get_dummy_value()


@intrinsic
def block_q8_0(typingctx, q, qo, s, so, xq, xo, dx, xsum, xb, acc):
    """acc += W[group] @ x̂ over one Q8_0 block."""
    return _sig(q, qo, s, so, xq, xo, dx, xsum, xb, acc), _block_q8_0


# ---- Q4_K: 256 values; qs[128] (pairs 0-63), scales[8] (pairs 64-67), mins[8] (pairs 68-71) -------------
# Sub-block 2i is the low nibbles of bytes 32i..32i+31, 2i+1 the high ones. 8 pairs per 16-bit accumulator
# (<= 30480), then widened.


def _block_q4_k(context, builder, signature, args):
    e = _Emitter(context, builder, signature, args, 144)
    q, qo, s, so, xq, xo, dx, xsum, xb, acc = e.vals
    b = e.b
    with e.chunks() as c:
        fd = _splat_const(F32, LANES, 0.0)
        fm = _splat_const(F32, LANES, 0.0)
        for i in range(4):  # sub-blocks 2i (low nibbles) and 2i + 1 (high)
            isum = [_zero32(), _zero32()]
            for half in range(2):
                acc16 = [_zero16(), _zero16()]
                for pp in range(8):
                    v = e.qpair(q, qo, c, i * 16 + half * 8 + pp)
                    ll = 2 * (half * 8 + pp)
                    for hi in range(2):
                        x = e.pair(xq, e.at(xo, (2 * i + hi) * 32 + ll))
                        acc16[hi] = b.add(acc16[hi], e.maddubs(e.nibbles(v, bool(hi)), x))
                isum = [b.add(isum[k], e.widen(acc16[k])) for k in range(2)]
            sc = e.even_odd_bytes(e.qpair(q, qo, c, 64 + i))
            mn = e.even_odd_bytes(e.qpair(q, qo, c, 68 + i))
            for hi in range(2):
                blk = e.at(xb, 2 * i + hi)
                d_x = e.load_scalar(dx, blk)
                scale = b.zext(sc[hi], _vt(I32, LANES))
                fd = b.fadd(fd, b.fmul(e.fsplat(d_x), e.to_float(b.mul(scale, isum[hi]))))
                sx = b.fmul(d_x, b.sitofp(_xsum32(e, xsum, blk), F32))
                fm = b.fadd(fm, b.fmul(b.uitofp(mn[hi], _vt(F32, LANES)), e.fsplat(sx)))
        d = e.halves(s, e.rows(so, c))
        dmin = e.halves(s, e.rows(so, c, 1))
        e.add_to_acc(acc, c, b.fsub(b.fmul(d, fd), b.fmul(dmin, fm)))
    return context.get_dummy_value()


@intrinsic
def block_q4_k(typingctx, q, qo, s, so, xq, xo, dx, xsum, xb, acc):
    """acc += W[group] @ x̂ over one Q4_K super-block."""
    return _sig(q, qo, s, so, xq, xo, dx, xsum, xb, acc), _block_q4_k


# ---- Q6_K: 256 values; ql[128] (pairs 0-63), qh[64] (pairs 64-95), int8 scales[16] (pairs 96-103) -------
# Value n*128 + 32k + l (n < 2, k < 4, l < 32): low 4 bits = nibble k // 2 of ql[64n + 32(k % 2) + l], high 2
# bits = bits 2k of qh[32n + l], minus 32; scale n*8 + 2k + l // 16. Values <= 63: pmaddubsw pairs <= 16002,
# 2 pairs per 16-bit accumulator (<= 32004), then widened.


def _block_q6_k(context, builder, signature, args):
    e = _Emitter(context, builder, signature, args, 208)
    q, qo, s, so, xq, xo, dx, xsum, xb, acc = e.vals
    b = e.b
    with e.chunks() as c:
        fd = _splat_const(F32, LANES, 0.0)
        scales = [e.even_odd_bytes(e.qpair(q, qo, c, 96 + p)) for p in range(8)]
        for n in range(2):
            for k in range(4):
                blk = e.at(xb, n * 4 + k)
                d_x = e.fsplat(e.load_scalar(dx, blk))
                for h in range(2):  # 16-value runs with their own scale
                    isum = _zero32()
                    acc16 = _zero16()
                    for pp in range(8):
                        ll = h * 16 + 2 * pp
                        lp = (64 * n + 32 * (k % 2) + ll) // 2
                        hp = 64 + (32 * n + ll) // 2
                        lo = e.qpair(q, qo, c, lp)
                        hb = e.qpair16(q, qo, c, hp)
                        v = b.or_(e.nibbles(lo, k >= 2), e.bits16(hb, 4 - 2 * k, 0x3030))
                        acc16 = b.add(acc16, e.maddubs(v, e.pair(xq, e.at(xo, (4 * n + k) * 32 + ll))))
                        if pp % 2 == 1:
                            isum = b.add(isum, e.widen(acc16))
                            acc16 = _zero16()
                    # the -32 of every value: 32 * sum(xq) over these 16
                    off16 = e.load_scalar(xsum, e.at(b.mul(blk, ir.Constant(I64, 2)), h))
                    isum = b.sub(isum, e.splat(b.mul(off16, ir.Constant(I32, 32)), LANES))
                    j = n * 8 + 2 * k + h  # scale index
                    scale = b.sext(scales[j // 2][j % 2], _vt(I32, LANES))
                    fd = b.fadd(fd, b.fmul(d_x, e.to_float(b.mul(scale, isum))))
        e.add_to_acc(acc, c, b.fmul(e.halves(s, e.rows(so, c)), fd))
    return context.get_dummy_value()


@intrinsic
def block_q6_k(typingctx, q, qo, s, so, xq, xo, dx, xsum, xb, acc):
    """acc += W[group] @ x̂ over one Q6_K super-block."""
    return _sig(q, qo, s, so, xq, xo, dx, xsum, xb, acc), _block_q6_k


BLOCK_KERNELS = {
    Q4_0: block_q4_0,
    Q4_1: block_q4_1,
    Q5_0: block_q5_0,
    Q8_0: block_q8_0,
    Q4_K: block_q4_k,
    Q6_K: block_q6_k,
}
