"""Block dot products written as LLVM vector IR, called from Numba like functions (`numba.extending.intrinsic`).

Numba's auto-vectorized loops over the packed layout reach ~1 byte of weights per vector instruction: every
nibble is widened to 32 bits and multiplied alone. These kernels keep bytes as bytes and multiply them in
groups with one instruction. The packed layout (packed.py) stores, for L rows at a time (one register), W
consecutive bytes of each row side by side: byte k of a block, for row l of an L-row chunk, is at
q[g, b, c, k // W, l, k % W]. So one register load is L rows x W consecutive bytes, and the activations
(x[k], .., x[k+W-1]) broadcast to every row feed the multiply directly:

- W = 2 (pairs): pmaddubsw (u8 x s8 -> adjacent pairs summed to s16), AVX2 (L = 16) or AVX-512BW (L = 32).
- W = 4 (quads): vpdpbusd (u8 x s8 -> 4 products summed into an s32 accumulator, no 16-bit step), AVX-512
  VNNI (L = 16) or AVX-VNNI (L = 8). Only some formats have quad kernels (`QUAD_CODES`); the others keep pairs.

Which instructions, and so which layout per format, is the `KernelSet` chosen from the compile target's CPU
features (`kernel_set`, from engine.runtime.kernel_isa): Numba compiles for the host CPU (or NUMBA_CPU_NAME /
NUMBA_CPU_FEATURES), and the kernel cache folder is keyed on the same features, so a kernel emitted for one
instruction set never runs on another CPU. Without AVX2 the same arithmetic is emitted as plain vector IR
(exact too, slower).

Each intrinsic handles one block of all ROWS rows of a group, L rows at a time, and adds its float32 results
to `acc` (ROWS,). Arguments are flat arrays and element offsets computed by the caller:

    q     uint8   flat packed bytes; qo: offset of this block (q[g, b, 0, 0, 0, 0])
    s     uint16  flat packed half-floats; so: offset of s[g, b, 0, 0]
    xq    int8    flat quantized activations; xo: offset of this block's first value
    dx    float32 activation scales per 32; xsum int32 (n/32, 2) flat: sums of xq per 16; xb: first 32-block

Prefill runs the `_tile` variants: TILE tokens per call, each block's bytes loaded and decoded once for all of
them (pair kernels read xq2, which holds every activation pair twice, so a pair is one 32-bit broadcast load;
see `xpair`), each token's results bit for bit those of the one-token kernel.

Integer sums are exact; the bounds that keep the 16-bit partial sums from saturating are noted at each pair
kernel (vpdpbusd has no 16-bit step). Every kernel set computes the same integer sums per row and block, and
the same float32 operations on them in the same order: the results are bit for bit the same on every CPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from ..runtime import AVX2, AVX512_BW, AVX512_VNNI, AVX_VNNI, PORTABLE, kernel_isa
from .cpu import Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

ROWS = 64  # rows per group (packed.ROWS)

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()

QUAD_CODES = frozenset({Q4_0, Q4_1, Q8_0, Q4_K, Q6_K})  # formats with a vpdpbusd kernel
_VPDPBUSD = {(AVX512_VNNI, 16): "llvm.x86.avx512.vpdpbusd.512", (AVX_VNNI, 8): "llvm.x86.avx512.vpdpbusd.256"}
# instruction set: (rows per register of pairs, pmaddubsw's LLVM intrinsic)
_PMADDUBSW = {
    AVX512_VNNI: (32, "llvm.x86.avx512.pmaddubs.w.512"),
    AVX512_BW: (32, "llvm.x86.avx512.pmaddubs.w.512"),
    AVX_VNNI: (16, "llvm.x86.avx2.pmadd.ub.sw"),
    AVX2: (16, "llvm.x86.avx2.pmadd.ub.sw"),
}


@dataclass(frozen=True)
class KernelSet:
    """The instructions the block kernels are emitted with, and so each format's packed layout."""

    isa: str  # engine.runtime's name: AVX512_VNNI, AVX_VNNI, AVX512_BW, AVX2 or PORTABLE
    vector_bytes: int  # one register: 64 (zmm) or 32 (ymm; plain vector IR for PORTABLE)
    quad_codes: frozenset[int]  # formats packed in quads for vpdpbusd; the others in pairs
    f16c: bool  # half -> float in one instruction (vcvtph2ps); else integer bit moves

    def layout(self, code: int) -> tuple[int, int]:
        """(L rows per register, W bytes of a row side by side) of format `code`'s packed q."""
        width = 4 if code in self.quad_codes else 2
        return self.vector_bytes // width, width


def kernel_set(isa: str, f16c: bool = True) -> KernelSet:
    """The kernel set for an instruction set name (engine.runtime.kernel_isa)."""
    wide = isa in (AVX512_BW, AVX512_VNNI)
    quads = QUAD_CODES if isa in (AVX512_VNNI, AVX_VNNI) else frozenset()
    if isa not in (AVX512_VNNI, AVX_VNNI, AVX512_BW, AVX2, PORTABLE):
        raise ValueError(f"unknown instruction set {isa!r}")
    return KernelSet(isa, 64 if wide else 32, quads, f16c)


def target_cpu() -> tuple[str, frozenset[str]]:
    """The CPU name and LLVM features Numba compiles for (the host's, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
    codegen = cpu_target.target_context.codegen()
    try:
        features = codegen._tm_features
        name = codegen._get_host_cpu_name()
    except AttributeError:  # a Numba without these private attributes: stay portable
        return "unknown", frozenset()
    return name, frozenset(f[1:] for f in features.split(",") if f.startswith("+"))


TARGET_NAME, TARGET_FEATURES = target_cpu()
KERNELS = kernel_set(kernel_isa(TARGET_FEATURES), "f16c" in TARGET_FEATURES)


def _vt(elt: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elt, n)


def _splat_const(elt: ir.Type, n: int, value) -> ir.Constant:
    return ir.Constant(_vt(elt, n), [value] * n)


@dataclass(frozen=True)
class _Token:
    """Where one token's operands are: xo, xb as in the module docstring, ao the offset of its ROWS results in acc."""

    xo: ir.Value
    xb: ir.Value
    ao: int
    doubled: bool = False  # xq holds every pair twice (`xpair`)


class _Emitter:
    """Small helpers over an IRBuilder, for the kernels below: L rows per register, W bytes of each."""

    def __init__(self, context, builder, signature, args, qb: int, code: int, kernels: KernelSet):
        self.b = builder
        self.k = kernels
        self.L, self.W = kernels.layout(code)
        self.chunk_bytes = qb * self.L  # bytes of one L-row chunk of a block
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
        """Loop over the ROWS / L slices of the group (a loop, not unrolled: it keeps compiles short)."""
        with cgutils.for_range(self.b, ir.Constant(I64, ROWS // self.L)) as loop:
            yield loop.index

    def zero16(self):
        return _splat_const(I16, self.L, 0)

    def zero32(self):
        return _splat_const(I32, self.L, 0)

    def qvec(self, q, qo, c, j: int):
        """<L*W x i8>: bytes W*j .. W*j + W-1 of the L rows of chunk c (q[g, b, c, j, :, :])."""
        off = self.b.add(self.at(qo, j * self.W * self.L), self.b.mul(c, ir.Constant(I64, self.chunk_bytes)))
        return self.load(q, off, I8, self.W * self.L)

    def qpair(self, q, qo, c, jp: int):
        """<2L x i8>: byte pair jp of the L rows of chunk c (pair layout)."""
        return self.qvec(q, qo, c, jp)

    def qpair16(self, q, qo, c, jp: int):
        """The same as L little-endian 16-bit words."""
        return self.b.bitcast(self.qpair(q, qo, c, jp), _vt(I16, self.L))

    def qquad32(self, q, qo, c, jq: int):
        """Quad jq of the L rows as L little-endian 32-bit words (quad layout)."""
        return self.b.bitcast(self.qvec(q, qo, c, jq), _vt(I32, self.L))

    def rows(self, base, c, k: int = 0):
        """Offset of field k (k * ROWS) of chunk c's rows in an s-like array."""
        return self.b.add(self.at(base, k * ROWS), self.b.mul(c, ir.Constant(I64, self.L)))

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
        """The bytes (xq[off], xq[off + 1]) repeated for L rows: <2L x i8>."""
        p = self.b.bitcast(self.b.gep(xq, [off]), I16.as_pointer())
        return self.b.bitcast(self.splat(self.b.load(p, align=1), self.L), _vt(I8, 2 * self.L))

    def xpair(self, xq, tok: _Token, k: int):
        """Token tok's activation pair (k, k + 1) of its block, repeated for L rows: <2L x i8>.

        With tok.doubled, xq holds each pair twice (4 bytes, value k at byte 2k) and one 32-bit broadcast
        load fetches it: no shuffle, as the 16-bit broadcast of `pair` takes.
        """
        off = self.at(tok.xo, k)
        if not tok.doubled:
            return self.pair(xq, off)
        p = self.b.bitcast(self.b.gep(xq, [self.b.mul(off, ir.Constant(I64, 2))]), I32.as_pointer())
        return self.b.bitcast(self.splat(self.b.load(p, align=1), self.L // 2), _vt(I8, 2 * self.L))

    def xquad(self, xq, tok: _Token, k: int):
        """Token tok's activations k .. k + 3 of its block, repeated for L rows: <4L x i8> (quad layout)."""
        p = self.b.bitcast(self.b.gep(xq, [self.at(tok.xo, k)]), I32.as_pointer())
        return self.b.bitcast(self.splat(self.b.load(p, align=1), self.L), _vt(I8, 4 * self.L))

    def nibbles(self, v, high: bool):
        """Low or high nibble of every byte of v <n x i8>."""
        n = v.type.count
        if high:  # no byte shift on x86: shift the 16-bit lanes, then mask
            v = self.b.bitcast(self.b.lshr(self.b.bitcast(v, _vt(I16, n // 2)), _splat_const(I16, n // 2, 4)), v.type)
        return self.b.and_(v, _splat_const(I8, n, 15))

    def bits16(self, h, shift: int, mask: int):
        """(h << shift) & mask per 16-bit lane for shift >= 0, (h >> -shift) & mask otherwise; as <2L x i8>."""
        if shift > 0:
            h = self.b.shl(h, _splat_const(I16, self.L, shift))
        elif shift < 0:
            h = self.b.lshr(h, _splat_const(I16, self.L, -shift))
        return self.b.bitcast(self.b.and_(h, _splat_const(I16, self.L, mask)), _vt(I8, 2 * self.L))

    def bits32(self, h, shift: int, mask: int):
        """bits16 for the quad layout: per 32-bit lane, as <4L x i8>."""
        if shift > 0:
            h = self.b.shl(h, _splat_const(I32, self.L, shift))
        elif shift < 0:
            h = self.b.lshr(h, _splat_const(I32, self.L, -shift))
        return self.b.bitcast(self.b.and_(h, _splat_const(I32, self.L, mask)), _vt(I8, 4 * self.L))

    def byte_of(self, w32, i: int, signed: bool):
        """Byte i of every 32-bit lane of w32 <L x i32>, zero- or sign-extended to i32."""
        if signed:
            return self.b.ashr(self.b.shl(w32, _splat_const(I32, self.L, 24 - 8 * i)), _splat_const(I32, self.L, 24))
        if i:
            w32 = self.b.lshr(w32, _splat_const(I32, self.L, 8 * i))
        return self.b.and_(w32, _splat_const(I32, self.L, 255))

    def _intrinsic(self, name: str, ret: ir.Type, args: list[ir.Type]):
        fn = self.b.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.b.module, ir.FunctionType(ret, args), name)
        return fn

    def maddubs(self, a, x):
        """<2L x i8> unsigned a, signed x -> <L x i16>: a[2i]x[2i] + a[2i+1]x[2i+1], saturated (pmaddubsw)."""
        n = self.L
        lanes, name = _PMADDUBSW.get(self.k.isa, (0, ""))
        if n == lanes:
            return self.b.call(self._intrinsic(name, _vt(I16, n), [_vt(I8, 2 * n)] * 2), [a, x])
        t32 = _vt(I32, n)
        even, odd = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
        p = self.b.add(
            self.b.mul(self.b.zext(self.shuffle(a, even), t32), self.b.sext(self.shuffle(x, even), t32)),
            self.b.mul(self.b.zext(self.shuffle(a, odd), t32), self.b.sext(self.shuffle(x, odd), t32)),
        )
        lo, hi = _splat_const(I32, n, -32768), _splat_const(I32, n, 32767)
        p = self.b.select(self.b.icmp_signed(">", p, lo), p, lo)
        p = self.b.select(self.b.icmp_signed("<", p, hi), p, hi)
        return self.b.trunc(p, _vt(I16, n))

    def pmaddwd(self, a, x):
        """<n x i16> a, x -> <n/2 x i32>: a[2i]x[2i] + a[2i+1]x[2i+1] (pmaddwd; cannot overflow)."""
        n = a.type.count
        name = None
        if self.k.isa != PORTABLE and n == 16:
            name = "llvm.x86.avx2.pmadd.wd"
        elif self.k.isa in (AVX512_BW, AVX512_VNNI) and n == 32:
            name = "llvm.x86.avx512.pmaddw.d.512"
        if name is not None:
            return self.b.call(self._intrinsic(name, _vt(I32, n // 2), [_vt(I16, n)] * 2), [a, x])
        t32 = _vt(I32, n // 2)
        even, odd = list(range(0, n, 2)), list(range(1, n, 2))
        return self.b.add(
            self.b.mul(self.b.sext(self.shuffle(a, even), t32), self.b.sext(self.shuffle(x, even), t32)),
            self.b.mul(self.b.sext(self.shuffle(a, odd), t32), self.b.sext(self.shuffle(x, odd), t32)),
        )

    def dpbusd(self, acc, a, x):
        """acc <L x i32> + the sums of 4 products of unsigned a, signed x <4L x i8> per lane (vpdpbusd)."""
        n = self.L
        name = _VPDPBUSD.get((self.k.isa, n))
        if name is not None:
            t = _vt(I32, n)
            fn = self._intrinsic(name, t, [t, t, t])
            return self.b.call(fn, [acc, self.b.bitcast(a, t), self.b.bitcast(x, t)])
        t32 = _vt(I32, n)
        for j in range(4):
            idx = list(range(j, 4 * n, 4))
            prod = self.b.mul(self.b.zext(self.shuffle(a, idx), t32), self.b.sext(self.shuffle(x, idx), t32))
            acc = self.b.add(acc, prod)
        return acc

    def by_parity(self, v16):
        """<L x i16> per-row factors -> (even rows', odd rows'), the other lanes zeroed: for `scaled_sums`."""
        n = self.L
        z = _splat_const(I16, n, 0)
        even = [r if r % 2 == 0 else n + r for r in range(n)]
        odd = [n + r if r % 2 == 0 else r for r in range(n)]
        sel = self.b.shuffle_vector
        return sel(v16, z, ir.Constant(_vt(I32, n), even)), sel(v16, z, ir.Constant(_vt(I32, n), odd))

    def scaled_sums(self, acc16, factor):
        """acc16 <L x i16> times a per-row factor (`by_parity`), widened: <L x i32> in parity order.

        Parity order holds rows 0, 2, ..., L-2, then 1, 3, ..., L-1: pmaddwd multiplies and widens in one
        instruction, against the three of a widening alone. `from_parity` restores row order.
        """
        return self.concat(self.pmaddwd(acc16, factor[0]), self.pmaddwd(acc16, factor[1]))

    def from_parity(self, v):
        """<L x ...> in parity order -> row order."""
        n = self.L
        return self.shuffle(v, [r // 2 + (n // 2) * (r % 2) for r in range(n)])

    def widen(self, v16):
        return self.b.sext(v16, _vt(I32, self.L))

    def even_odd_bytes(self, v):
        """<2L x i8> of L rows' byte pairs -> (first bytes, second bytes), each <L x i8>."""
        n = 2 * self.L
        return self.shuffle(v, list(range(0, n, 2))), self.shuffle(v, list(range(1, n, 2)))

    def halves(self, s, off):
        """L rows' half-floats at s[off] as <L x float>: vcvtph2ps with F16C, else exact integer moves."""
        n = self.L
        h = self.load(s, off, I16, n)
        if self.k.f16c:
            return self.b.fpext(self.b.bitcast(h, _vt(F16, n)), _vt(F32, n))
        b = self.b
        v = b.zext(h, _vt(I32, n))  # as packed.h2f: sign and magnitude moved into place, times 2**112
        mag = b.shl(b.and_(v, _splat_const(I32, n, 0x7FFF)), _splat_const(I32, n, 13))
        bits = b.or_(mag, b.shl(b.and_(v, _splat_const(I32, n, 0x8000)), _splat_const(I32, n, 16)))
        finite = b.fmul(b.bitcast(bits, _vt(F32, n)), _splat_const(F32, n, 2.0**112))
        special = b.bitcast(b.or_(bits, _splat_const(I32, n, 0x7F800000)), _vt(F32, n))
        exp31 = b.icmp_unsigned("==", b.and_(v, _splat_const(I32, n, 0x7C00)), _splat_const(I32, n, 0x7C00))
        return b.select(exp31, special, finite)

    def fsplat(self, f):
        return self.splat(f, self.L)

    def to_float(self, i32v):
        return self.b.sitofp(i32v, _vt(F32, self.L))

    def add_to_acc(self, acc, tok: _Token, c, v):
        """acc[tok.ao + Lc : tok.ao + Lc + L] += v."""
        off = self.at(self.b.mul(c, ir.Constant(I64, self.L)), tok.ao)
        self.store(acc, off, self.b.fadd(self.load(acc, off, F32, self.L), v))


def _xsum32(e: _Emitter, xsum, xb):
    """Sum of xq over the 32-block xb (two 16-sums), as i32."""
    i = e.b.mul(xb, ir.Constant(I64, 2))
    return e.b.add(e.load_scalar(xsum, i), e.load_scalar(xsum, e.at(i, 1)))


# Each kernel below is written once, for a list of tokens: the weight bytes of a chunk are loaded and decoded
# once and multiplied with every token's activations, each token adding into its own integer sums and then its
# own acc row. The float operations of one token are the same, in the same order, for any number of tokens,
# so the multi-token kernels give the single-token results bit for bit.
#
# YMM registers (16 on AVX2) bound the tile: a token holds one or two 16-bit accumulators and one 32-bit one
# (two registers) live in the inner loop, besides the decoded bytes and the masks. TILE = 4 measured faster
# than 2 for every format (Zen 3); so did 4 tokens sharing one decode for Q4_K and Q6_K, against two passes of 2.


# ---- Q4_0, Q4_1: 16 bytes, 8 pairs; value = nibble (- 8 for Q4_0) --------------------------------------
# Each pmaddubsw sums 2 products <= 15 * 127; 8 pairs per accumulator: <= 30480, no saturation.


def _emit_q4(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token], with_min: bool) -> None:
    b = e.b
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    total = [_xsum32(e, xsum, t.xb) for t in toks]
    if with_min:  # the min term: m * sum(x̂)
        sx = [e.fsplat(b.fmul(e.load_scalar(dx, t.xb), b.sitofp(tot, F32))) for t, tot in zip(toks, total, strict=True)]
    else:  # every value is nibble - 8
        offset = [e.splat(b.mul(tot, ir.Constant(I32, 8)), e.L) for tot in total]
    with e.chunks() as c:
        acc_lo, acc_hi = [e.zero16()] * len(toks), [e.zero16()] * len(toks)
        for jp in range(8):  # byte pair (2jp, 2jp+1): low nibbles are values 2jp.., high ones 16 + 2jp..
            v = e.qpair(q, qo, c, jp)
            lo, hi = e.nibbles(v, False), e.nibbles(v, True)
            for i, t in enumerate(toks):
                acc_lo[i] = b.add(acc_lo[i], e.maddubs(lo, e.xpair(xq, t, 2 * jp)))
                acc_hi[i] = b.add(acc_hi[i], e.maddubs(hi, e.xpair(xq, t, 16 + 2 * jp)))
        d = e.halves(s, e.rows(so, c))
        m = e.halves(s, e.rows(so, c, 1)) if with_min else None
        for i, t in enumerate(toks):
            isum = b.add(e.widen(acc_lo[i]), e.widen(acc_hi[i]))  # (16,) i32: per row, nibble . xq
            if not with_min:
                isum = b.sub(isum, offset[i])
            part = b.fmul(d, b.fmul(d_x[i], e.to_float(isum)))
            if with_min:
                part = b.fadd(part, b.fmul(m, sx[i]))
            e.add_to_acc(acc, t, c, part)


# ---- Q5_0, Q5_1: nibbles plus a fifth bit from two qh fields (values 0-15, 16-31; - 16 for Q5_0) ---------
# The qh fields (s[1], s[2] for Q5_0; s[2], s[3] for Q5_1, after d and m) hold qh's bits reordered at packing:
# low byte = bits of the even values, high byte = odd ones, so bit jp of each byte belongs to byte pair jp.
# Values <= 31: pmaddubsw pairs <= 7874, 2 byte pairs (4 pmaddubsw) per 16-bit accumulator (<= 31496), then
# widened.


def _emit_q5(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token], with_min: bool) -> None:
    b = e.b
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    total = [_xsum32(e, xsum, t.xb) for t in toks]
    if with_min:  # the min term: m * sum(x̂)
        sx = [e.fsplat(b.fmul(e.load_scalar(dx, t.xb), b.sitofp(tot, F32))) for t, tot in zip(toks, total, strict=True)]
    else:  # every value is v - 16
        offset = [e.splat(b.mul(tot, ir.Constant(I32, 16)), e.L) for tot in total]
    qh = 2 if with_min else 1  # index of the first qh field
    with e.chunks() as c:
        h_lo = e.load(s, e.rows(so, c, qh), I16, e.L)
        h_hi = e.load(s, e.rows(so, c, qh + 1), I16, e.L)
        isum = [e.zero32()] * len(toks)
        acc16 = [e.zero16()] * len(toks)
        for jp in range(8):
            v = e.qpair(q, qo, c, jp)
            lo = b.or_(e.nibbles(v, False), e.bits16(h_lo, 4 - jp, 0x1010))
            hi = b.or_(e.nibbles(v, True), e.bits16(h_hi, 4 - jp, 0x1010))
            for i, t in enumerate(toks):
                acc16[i] = b.add(acc16[i], e.maddubs(lo, e.xpair(xq, t, 2 * jp)))
                acc16[i] = b.add(acc16[i], e.maddubs(hi, e.xpair(xq, t, 16 + 2 * jp)))
                if jp % 2 == 1:
                    isum[i] = b.add(isum[i], e.widen(acc16[i]))
                    acc16[i] = e.zero16()
        d = e.halves(s, e.rows(so, c))
        m = e.halves(s, e.rows(so, c, 1)) if with_min else None
        for i, t in enumerate(toks):
            if with_min:
                part = b.fadd(b.fmul(d, b.fmul(d_x[i], e.to_float(isum[i]))), b.fmul(m, sx[i]))
            else:
                part = b.fmul(d, b.fmul(d_x[i], e.to_float(b.sub(isum[i], offset[i]))))
            e.add_to_acc(acc, t, c, part)


# ---- Q8_0: 32 signed bytes, 16 pairs; pmaddwd on bytes widened to 16 bits ------------------------------


def _emit_q8_0(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token]) -> None:
    b = e.b
    n = e.L  # 16-bit values in half a register's rows: L/2 rows x 2
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    # per token, the 16 pairs widened; the pattern repeats, so half the rows' worth (<L x i16>) is enough
    xpairs = [
        [e.shuffle(b.sext(e.xpair(xq, t, 2 * jp), _vt(I16, 2 * n)), list(range(n))) for jp in range(16)] for t in toks
    ]
    with e.chunks() as c:
        sums = [[_splat_const(I32, n // 2, 0), _splat_const(I32, n // 2, 0)] for _ in toks]
        for jp in range(16):
            v = b.sext(e.qpair(q, qo, c, jp), _vt(I16, 2 * n))
            parts = [e.shuffle(v, list(range(n * h, n * h + n))) for h in range(2)]  # the first, last L/2 rows
            for i in range(len(toks)):
                for h in range(2):
                    sums[i][h] = b.add(sums[i][h], e.pmaddwd(parts[h], xpairs[i][jp]))
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            isum = e.concat(sums[i][0], sums[i][1])
            e.add_to_acc(acc, t, c, b.fmul(d, b.fmul(d_x[i], e.to_float(isum))))


# ---- Q4_K, Q5_K: 256 values; qs[128] (pairs 0-63), scales[8] (pairs 64-67), mins[8] (pairs 68-71), and for
# Q5_K qh[32] (pairs 72-87) ---------------------------------------------------------------------------------
# Sub-block 2i is the low nibbles of bytes 32i..32i+31, 2i+1 the high ones; Q5_K adds bit 2i (2i + 1) of
# qh[l] as the fifth bit of value l. Q4_K: 8 pairs per 16-bit accumulator (<= 30480); Q5_K (values <= 31):
# 4 pairs (<= 31496); then scaled and widened (scale <= 63).


def _emit_k_quant(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token], fifth_bit: bool) -> None:
    b = e.b
    per_acc = 4 if fifth_bit else 8  # byte pairs per 16-bit accumulator
    with e.chunks() as c:
        fd = [_splat_const(F32, e.L, 0.0)] * len(toks)  # in parity order (`scaled_sums`)
        for i in range(4):
            sc = e.even_odd_bytes(e.qpair(q, qo, c, 64 + i))
            for hi in range(2):  # sub-block 2i + hi: the low nibbles of bytes 32i.., then the high ones
                scale = e.by_parity(b.zext(sc[hi], _vt(I16, e.L)))
                isum = [e.zero32()] * len(toks)  # scale * (values . xq): <= 63 * 125984
                acc16 = [e.zero16()] * len(toks)
                for pp in range(16):
                    v = e.nibbles(e.qpair(q, qo, c, i * 16 + pp), bool(hi))
                    if fifth_bit:
                        v = b.or_(v, e.bits16(e.qpair16(q, qo, c, 72 + pp), 4 - (2 * i + hi), 0x1010))
                    for k, t in enumerate(toks):
                        acc16[k] = b.add(acc16[k], e.maddubs(v, e.xpair(xq, t, (2 * i + hi) * 32 + 2 * pp)))
                        if pp % per_acc == per_acc - 1:
                            isum[k] = b.add(isum[k], e.scaled_sums(acc16[k], scale))
                            acc16[k] = e.zero16()
                for k, t in enumerate(toks):
                    d_x = e.fsplat(e.load_scalar(dx, e.at(t.xb, 2 * i + hi)))
                    fd[k] = b.fadd(fd[k], b.fmul(d_x, e.to_float(isum[k])))
        d = e.halves(s, e.rows(so, c))
        dmin = e.halves(s, e.rows(so, c, 1))
        mins = [e.even_odd_bytes(e.qpair(q, qo, c, 68 + i)) for i in range(4)]
        for k, t in enumerate(toks):
            fm = _splat_const(F32, e.L, 0.0)  # the mins against the sums of x̂
            for i in range(4):
                for hi in range(2):
                    blk = e.at(t.xb, 2 * i + hi)
                    sx = b.fmul(e.load_scalar(dx, blk), b.sitofp(_xsum32(e, xsum, blk), F32))
                    fm = b.fadd(fm, b.fmul(b.uitofp(mins[i][hi], _vt(F32, e.L)), e.fsplat(sx)))
            e.add_to_acc(acc, t, c, b.fsub(b.fmul(d, e.from_parity(fd[k])), b.fmul(dmin, fm)))


# ---- Q6_K: 256 values; ql[128] (pairs 0-63), qh[64] (pairs 64-95), int8 scales[16] (pairs 96-103) -------
# Value n*128 + 32k + l (n < 2, k < 4, l < 32): low 4 bits = nibble k // 2 of ql[64n + 32(k % 2) + l], high 2
# bits = bits 2k of qh[32n + l], minus 32; scale n*8 + 2k + l // 16. Values <= 63: pmaddubsw pairs <= 16002,
# 2 pairs per 16-bit accumulator (<= 32004), then scaled and widened (|scale * sum| <= 128 * 128016).


def _emit_q6_k(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token]) -> None:
    b = e.b
    with e.chunks() as c:
        fd = [_splat_const(F32, e.L, 0.0)] * len(toks)  # in parity order (`scaled_sums`)
        for n in range(2):
            for k in range(4):
                for h in range(2):  # 16-value runs with their own scale
                    j = n * 8 + 2 * k + h  # scale index
                    sc16 = b.sext(e.even_odd_bytes(e.qpair(q, qo, c, 96 + j // 2))[j % 2], _vt(I16, e.L))
                    scale = e.by_parity(sc16)
                    scale32 = e.by_parity(b.mul(sc16, _splat_const(I16, e.L, 32)))  # |32 * scale| <= 4096
                    isum = [e.zero32()] * len(toks)
                    acc16 = [e.zero16()] * len(toks)
                    for pp in range(8):
                        ll = h * 16 + 2 * pp
                        lp = (64 * n + 32 * (k % 2) + ll) // 2
                        hp = 64 + (32 * n + ll) // 2
                        lo = e.qpair(q, qo, c, lp)
                        hb = e.qpair16(q, qo, c, hp)
                        v = b.or_(e.nibbles(lo, k >= 2), e.bits16(hb, 4 - 2 * k, 0x3030))
                        for i, t in enumerate(toks):
                            acc16[i] = b.add(acc16[i], e.maddubs(v, e.xpair(xq, t, (4 * n + k) * 32 + ll)))
                            if pp % 2 == 1:
                                isum[i] = b.add(isum[i], e.scaled_sums(acc16[i], scale))
                                acc16[i] = e.zero16()
                    for i, t in enumerate(toks):
                        blk = e.at(t.xb, n * 4 + k)
                        # the -32 of every value: scale * 32 * sum(xq) over these 16 (|sum| <= 2032)
                        off16 = e.load_scalar(xsum, e.at(b.mul(blk, ir.Constant(I64, 2)), h))
                        off = e.scaled_sums(e.splat(b.trunc(off16, I16), e.L), scale32)
                        d_x = e.fsplat(e.load_scalar(dx, blk))
                        fd[i] = b.fadd(fd[i], b.fmul(d_x, e.to_float(b.sub(isum[i], off))))
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fmul(d, e.from_parity(fd[i])))


# ---- Q2_K: 256 values; qs[64] (pairs 0-31), scales[16] (pairs 32-39: scale in the low nibble, min high) ---
# Value n*128 + 32j + l (n < 2, j < 4, l < 32) = bits 2j of qs[32n + l]; run n*8 + 2j + l // 16 has its own
# scale and min: W = d * scale * value - dmin * min. Values <= 3: a run (8 pairs) per 16-bit accumulator
# (<= 6096), scaled and widened (scale <= 15); the two runs of a 32-block meet in one 32-bit sum.


def _emit_q2_k(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token]) -> None:
    b = e.b
    with e.chunks() as c:
        fd = [_splat_const(F32, e.L, 0.0)] * len(toks)  # in parity order (`scaled_sums`)
        fm = [_splat_const(F32, e.L, 0.0)] * len(toks)  # the mins against the sums of x̂, parity order
        for n in range(2):
            for j in range(4):
                isum = [e.zero32()] * len(toks)
                msum = [e.zero32()] * len(toks)
                for h in range(2):  # 16-value runs with their own scale and min
                    idx = n * 8 + 2 * j + h
                    sc16 = b.zext(e.even_odd_bytes(e.qpair(q, qo, c, 32 + idx // 2))[idx % 2], _vt(I16, e.L))
                    scale = e.by_parity(b.and_(sc16, _splat_const(I16, e.L, 15)))
                    mn = e.by_parity(b.lshr(sc16, _splat_const(I16, e.L, 4)))
                    acc16 = [e.zero16()] * len(toks)
                    for pp in range(8):
                        ll = h * 16 + 2 * pp
                        v = e.bits16(e.qpair16(q, qo, c, (32 * n + ll) // 2), -2 * j, 0x0303)
                        for i, t in enumerate(toks):
                            acc16[i] = b.add(acc16[i], e.maddubs(v, e.xpair(xq, t, (4 * n + j) * 32 + ll)))
                    for i, t in enumerate(toks):
                        blk = e.at(t.xb, n * 4 + j)
                        sx16 = e.load_scalar(xsum, e.at(b.mul(blk, ir.Constant(I64, 2)), h))  # |sum| <= 2032
                        isum[i] = b.add(isum[i], e.scaled_sums(acc16[i], scale))
                        msum[i] = b.add(msum[i], e.scaled_sums(e.splat(b.trunc(sx16, I16), e.L), mn))
                for i, t in enumerate(toks):
                    d_x = e.fsplat(e.load_scalar(dx, e.at(t.xb, n * 4 + j)))
                    fd[i] = b.fadd(fd[i], b.fmul(d_x, e.to_float(isum[i])))
                    fm[i] = b.fadd(fm[i], b.fmul(d_x, e.to_float(msum[i])))
        d = e.halves(s, e.rows(so, c))
        dmin = e.halves(s, e.rows(so, c, 1))
        for i, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fsub(b.fmul(d, e.from_parity(fd[i])), b.fmul(dmin, e.from_parity(fm[i]))))


# ---- Q3_K: 256 values; qs[64] (pairs 0-31), hmask[32] (pairs 32-47), int8 scales[16] (pairs 48-55) ------
# Value n*128 + 32j + l (n < 2, j < 4, l < 32): low 2 bits = bits 2j of qs[32n + l], third bit = bit 4n + j
# of hmask[l], minus 4; scale n*8 + 2j + l // 16. Values <= 7: a 16-value run (8 pairs) per 16-bit
# accumulator (<= 14224), then scaled and widened (|scale| <= 32).


def _emit_q3_k(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token]) -> None:
    b = e.b
    with e.chunks() as c:
        fd = [_splat_const(F32, e.L, 0.0)] * len(toks)  # in parity order (`scaled_sums`)
        for n in range(2):
            for j in range(4):
                for h in range(2):  # 16-value runs with their own scale
                    idx = n * 8 + 2 * j + h  # scale index
                    sc16 = b.sext(e.even_odd_bytes(e.qpair(q, qo, c, 48 + idx // 2))[idx % 2], _vt(I16, e.L))
                    scale = e.by_parity(sc16)
                    scale4 = e.by_parity(b.mul(sc16, _splat_const(I16, e.L, 4)))  # |4 * scale| <= 128
                    acc16 = [e.zero16()] * len(toks)
                    for pp in range(8):
                        ll = h * 16 + 2 * pp
                        low = e.bits16(e.qpair16(q, qo, c, (32 * n + ll) // 2), -2 * j, 0x0303)
                        high = e.bits16(e.qpair16(q, qo, c, 32 + ll // 2), 2 - (4 * n + j), 0x0404)
                        v = b.or_(low, high)
                        for i, t in enumerate(toks):
                            acc16[i] = b.add(acc16[i], e.maddubs(v, e.xpair(xq, t, (4 * n + j) * 32 + ll)))
                    for i, t in enumerate(toks):
                        blk = e.at(t.xb, n * 4 + j)
                        # the -4 of every value: scale * 4 * sum(xq) over these 16 (|sum| <= 2032)
                        off16 = e.load_scalar(xsum, e.at(b.mul(blk, ir.Constant(I64, 2)), h))
                        off = e.scaled_sums(e.splat(b.trunc(off16, I16), e.L), scale4)
                        isum = e.scaled_sums(acc16[i], scale)
                        d_x = e.fsplat(e.load_scalar(dx, blk))
                        fd[i] = b.fadd(fd[i], b.fmul(d_x, e.to_float(b.sub(isum, off))))
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fmul(d, e.from_parity(fd[i])))


# ---- quad kernels (vpdpbusd): the same integer sums per row and block as the pair kernels above, summed in
# 32 bits directly, then the same float operations in the same order, so the results are bit for bit theirs.
# vpdpbusd adds into its accumulator (4-5 cycles a step): four accumulators per token take turns, so that
# consecutive ones do not wait on each other.


def _dot_runs(e: _Emitter, toks: list[_Token], xq, quads) -> list:
    """Per token, sum over (v, k) in quads of vpdpbusd(v, x̂[k : k + 4]): <L x i32>."""
    n_acc = min(4, len(quads))
    accs = [[e.zero32()] * n_acc for _ in toks]
    for n, (v, k) in enumerate(quads):
        for i, t in enumerate(toks):
            accs[i][n % n_acc] = e.dpbusd(accs[i][n % n_acc], v, e.xquad(xq, t, k))
    out = []
    for a in accs:
        while len(a) > 1:  # a pairwise tree: exact in integers, whatever the order
            a = [e.b.add(a[j], a[j + 1]) if j + 1 < len(a) else a[j] for j in range(0, len(a), 2)]
        out.append(a[0])
    return out


def _emit_q4_quad(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token], with_min: bool) -> None:
    b = e.b
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    total = [_xsum32(e, xsum, t.xb) for t in toks]
    if with_min:
        sx = [e.fsplat(b.fmul(e.load_scalar(dx, t.xb), b.sitofp(tot, F32))) for t, tot in zip(toks, total, strict=True)]
    else:
        offset = [e.splat(b.mul(tot, ir.Constant(I32, 8)), e.L) for tot in total]
    with e.chunks() as c:
        quads = []
        for jq in range(4):  # bytes 4jq..4jq+3: low nibbles are values 4jq.., high ones 16 + 4jq..
            v = e.qvec(q, qo, c, jq)
            quads += [(e.nibbles(v, False), 4 * jq), (e.nibbles(v, True), 16 + 4 * jq)]
        isums = _dot_runs(e, toks, xq, quads)
        d = e.halves(s, e.rows(so, c))
        m = e.halves(s, e.rows(so, c, 1)) if with_min else None
        for i, t in enumerate(toks):
            isum = isums[i] if with_min else b.sub(isums[i], offset[i])
            part = b.fmul(d, b.fmul(d_x[i], e.to_float(isum)))
            if with_min:
                part = b.fadd(part, b.fmul(m, sx[i]))
            e.add_to_acc(acc, t, c, part)


def _emit_q8_0_quad(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token]) -> None:
    """Signed weights: vpdpbusd takes w + 128 (w ^ 0x80) as unsigned, and 128 * sum(x̂) comes off again."""
    b = e.b
    d_x = [e.fsplat(e.load_scalar(dx, t.xb)) for t in toks]
    offset = [e.splat(b.mul(_xsum32(e, xsum, t.xb), ir.Constant(I32, 128)), e.L) for t in toks]
    flip = _splat_const(I8, 4 * e.L, -128)
    with e.chunks() as c:
        quads = [(b.xor(e.qvec(q, qo, c, jq), flip), 4 * jq) for jq in range(8)]
        isums = _dot_runs(e, toks, xq, quads)  # <= 255 * 127 * 32: exact
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            isum = b.sub(isums[i], offset[i])
            e.add_to_acc(acc, t, c, b.fmul(d, b.fmul(d_x[i], e.to_float(isum))))


def _emit_q4_k_quad(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token]) -> None:
    """Q4_K: quads 0-31 qs, 32-33 scales[8], 34-35 mins[8] (one byte per sub-block)."""
    b = e.b
    with e.chunks() as c:
        fd = [_splat_const(F32, e.L, 0.0)] * len(toks)
        scales = [e.qquad32(q, qo, c, 32 + h) for h in range(2)]
        for i in range(4):
            for hi in range(2):  # sub-block 2i + hi: the low nibbles of bytes 32i.., then the high ones
                j = 2 * i + hi
                scale = e.byte_of(scales[j // 4], j % 4, False)
                quads = [(e.nibbles(e.qvec(q, qo, c, 8 * i + pq), bool(hi)), j * 32 + 4 * pq) for pq in range(8)]
                isums = _dot_runs(e, toks, xq, quads)
                for k, t in enumerate(toks):
                    d_x = e.fsplat(e.load_scalar(dx, e.at(t.xb, j)))
                    fd[k] = b.fadd(fd[k], b.fmul(d_x, e.to_float(b.mul(isums[k], scale))))
        d = e.halves(s, e.rows(so, c))
        dmin = e.halves(s, e.rows(so, c, 1))
        mins = [e.qquad32(q, qo, c, 34 + h) for h in range(2)]
        for k, t in enumerate(toks):
            fm = _splat_const(F32, e.L, 0.0)
            for j in range(8):
                blk = e.at(t.xb, j)
                sx = b.fmul(e.load_scalar(dx, blk), b.sitofp(_xsum32(e, xsum, blk), F32))
                fm = b.fadd(fm, b.fmul(b.sitofp(e.byte_of(mins[j // 4], j % 4, False), _vt(F32, e.L)), e.fsplat(sx)))
            e.add_to_acc(acc, t, c, b.fsub(b.fmul(d, fd[k]), b.fmul(dmin, fm)))


def _emit_q6_k_quad(e: _Emitter, q, qo, s, so, xq, dx, xsum, acc, toks: list[_Token]) -> None:
    """Q6_K: quads 0-31 ql, 32-47 qh, 48-51 int8 scales[16]."""
    b = e.b
    with e.chunks() as c:
        fd = [_splat_const(F32, e.L, 0.0)] * len(toks)
        for n in range(2):
            for k in range(4):
                for h in range(2):  # 16-value runs with their own scale
                    j = n * 8 + 2 * k + h  # scale index
                    scale = e.byte_of(e.qquad32(q, qo, c, 48 + j // 4), j % 4, True)
                    quads = []
                    for pq in range(4):
                        ll = h * 16 + 4 * pq
                        lo = e.qvec(q, qo, c, (64 * n + 32 * (k % 2) + ll) // 4)
                        hb = e.qquad32(q, qo, c, 32 + (32 * n + ll) // 4)
                        v = b.or_(e.nibbles(lo, k >= 2), e.bits32(hb, 4 - 2 * k, 0x30303030))
                        quads.append((v, (4 * n + k) * 32 + ll))
                    isums = _dot_runs(e, toks, xq, quads)
                    for i, t in enumerate(toks):
                        blk = e.at(t.xb, n * 4 + k)
                        # the -32 of every value: scale * 32 * sum(xq) over these 16
                        off16 = e.load_scalar(xsum, e.at(b.mul(blk, ir.Constant(I64, 2)), h))
                        off = b.mul(e.splat(b.mul(off16, ir.Constant(I32, 32)), e.L), scale)
                        d_x = e.fsplat(e.load_scalar(dx, blk))
                        fd[i] = b.fadd(fd[i], b.fmul(d_x, e.to_float(b.sub(b.mul(isums[i], scale), off))))
        d = e.halves(s, e.rows(so, c))
        for i, t in enumerate(toks):
            e.add_to_acc(acc, t, c, b.fmul(d, fd[i]))


# ---- the intrinsics -------------------------------------------------------------------------------------
# block_<type>(q, qo, s, so, xq, xo, dx, xsum, xb, acc): acc (ROWS,) += W[group] @ x̂ over one block, one token.
# block_<type>_tile(q, qo, s, so, xq, xq2, xo, xstep, dx, xsum, xb, bstep, acc): the same for TILE tokens at
# once, token t's operands at xo + t*xstep (in xq, or for pair kernels in xq2: every pair twice) and
# xb + t*bstep (dx, xsum), its results in acc[t*ROWS : (t+1)*ROWS].

TILE = 4  # tokens per multi-token kernel call


def _emit_q4_0(e: _Emitter, *args) -> None:
    (_emit_q4_quad if e.W == 4 else _emit_q4)(e, *args, with_min=False)


def _emit_q4_1(e: _Emitter, *args) -> None:
    (_emit_q4_quad if e.W == 4 else _emit_q4)(e, *args, with_min=True)


def _emit_q5_0(e: _Emitter, *args) -> None:
    _emit_q5(e, *args, with_min=False)


def _emit_q5_1(e: _Emitter, *args) -> None:
    _emit_q5(e, *args, with_min=True)


def _emit_q8(e: _Emitter, *args) -> None:
    (_emit_q8_0_quad if e.W == 4 else _emit_q8_0)(e, *args)


def _emit_q4_k(e: _Emitter, *args) -> None:
    if e.W == 4:
        _emit_q4_k_quad(e, *args)
    else:
        _emit_k_quant(e, *args, fifth_bit=False)


def _emit_q5_k(e: _Emitter, *args) -> None:
    _emit_k_quant(e, *args, fifth_bit=True)


def _emit_q6(e: _Emitter, *args) -> None:
    (_emit_q6_k_quad if e.W == 4 else _emit_q6_k)(e, *args)


# code: (quant bytes per block in q, as packed.LAYOUT; emitter)
EMITTERS = {
    Q4_0: (16, _emit_q4_0),
    Q4_1: (16, _emit_q4_1),
    Q5_0: (16, _emit_q5_0),
    Q5_1: (16, _emit_q5_1),
    Q8_0: (32, _emit_q8),
    Q2_K: (80, _emit_q2_k),
    Q3_K: (112, _emit_q3_k),
    Q4_K: (144, _emit_q4_k),
    Q5_K: (176, _emit_q5_k),
    Q6_K: (208, _emit_q6),
}


def _one(name: str, code: int, doc: str, kernels: KernelSet):
    qb, emit = EMITTERS[code]

    def codegen(context, builder, signature, args):
        e = _Emitter(context, builder, signature, args, qb, code, kernels)
        q, qo, s, so, xq, xo, dx, xsum, xb, acc = e.vals
        emit(e, q, qo, s, so, xq, dx, xsum, acc, [_Token(xo, xb, 0)])
        return context.get_dummy_value()

    def kernel(typingctx, q, qo, s, so, xq, xo, dx, xsum, xb, acc):
        return types.void(q, qo, s, so, xq, xo, dx, xsum, xb, acc), codegen

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = doc
    return intrinsic(kernel)


def _tile(name: str, code: int, doc: str, kernels: KernelSet):
    qb, emit = EMITTERS[code]

    def codegen(context, builder, signature, args):
        e = _Emitter(context, builder, signature, args, qb, code, kernels)
        q, qo, s, so, xq, xq2, xo, xstep, dx, xsum, xb, bstep, acc = e.vals
        b = e.b
        doubled = e.W == 2  # pair kernels broadcast a pair from xq2 in one 32-bit load
        toks = [
            _Token(
                b.add(xo, b.mul(xstep, ir.Constant(I64, t))),
                b.add(xb, b.mul(bstep, ir.Constant(I64, t))),
                t * ROWS,
                doubled,
            )
            for t in range(TILE)
        ]
        emit(e, q, qo, s, so, xq2 if doubled else xq, dx, xsum, acc, toks)
        return context.get_dummy_value()

    def kernel(typingctx, q, qo, s, so, xq, xq2, xo, xstep, dx, xsum, xb, bstep, acc):
        return types.void(q, qo, s, so, xq, xq2, xo, xstep, dx, xsum, xb, bstep, acc), codegen

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = doc
    return intrinsic(kernel)


_NAMES = {Q4_0: "q4_0", Q4_1: "q4_1", Q5_0: "q5_0", Q5_1: "q5_1", Q8_0: "q8_0"}
_NAMES |= {Q2_K: "q2_k", Q3_K: "q3_k", Q4_K: "q4_k", Q5_K: "q5_k", Q6_K: "q6_k"}


def build_kernels(kernels: KernelSet) -> dict[str, object]:
    """Every block kernel emitted with `kernels`, by name (block_q4_k, block_q4_k_tile, ...).

    The module's own kernels below are KERNELS's; another set runs only where its instructions exist, on
    weights packed in its layout (benchmarks compare kernel sets in one process this way).
    """
    out = {}
    for code, t in _NAMES.items():
        kind = "super-block" if code >= Q2_K else "block"
        out[f"block_{t}"] = _one(f"block_{t}", code, f"acc += W[group] @ x̂ over one {t.upper()} {kind}.", kernels)
        out[f"block_{t}_tile"] = _tile(f"block_{t}_tile", code, f"block_{t} for TILE tokens at once.", kernels)
    return out


_HOST = build_kernels(KERNELS)
block_q4_0, block_q4_0_tile = _HOST["block_q4_0"], _HOST["block_q4_0_tile"]
block_q4_1, block_q4_1_tile = _HOST["block_q4_1"], _HOST["block_q4_1_tile"]
block_q5_0, block_q5_0_tile = _HOST["block_q5_0"], _HOST["block_q5_0_tile"]
block_q5_1, block_q5_1_tile = _HOST["block_q5_1"], _HOST["block_q5_1_tile"]
block_q8_0, block_q8_0_tile = _HOST["block_q8_0"], _HOST["block_q8_0_tile"]
block_q2_k, block_q2_k_tile = _HOST["block_q2_k"], _HOST["block_q2_k_tile"]
block_q3_k, block_q3_k_tile = _HOST["block_q3_k"], _HOST["block_q3_k_tile"]
block_q4_k, block_q4_k_tile = _HOST["block_q4_k"], _HOST["block_q4_k_tile"]
block_q5_k, block_q5_k_tile = _HOST["block_q5_k"], _HOST["block_q5_k_tile"]
block_q6_k, block_q6_k_tile = _HOST["block_q6_k"], _HOST["block_q6_k_tile"]

BLOCK_KERNELS = {
    Q4_0: block_q4_0,
    Q4_1: block_q4_1,
    Q5_0: block_q5_0,
    Q5_1: block_q5_1,
    Q8_0: block_q8_0,
    Q2_K: block_q2_k,
    Q3_K: block_q3_k,
    Q4_K: block_q4_k,
    Q5_K: block_q5_k,
    Q6_K: block_q6_k,
}
