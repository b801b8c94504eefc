"""The toolkit the SIMD block kernels are written with: LLVM vector IR emitted from Python, per instruction set.

Each format's emitters (<type>.py here) build their kernel from the `Emitter` below; engine/kernels/simd.py
turns them into intrinsics Numba calls like functions. The packed layout (engine/kernels/packed.py) stores, for
L rows at a time (one register), W consecutive bytes of each row side by side: byte k of a block, for row l of
an L-row chunk, is at q[g, b, c, k // W, l, k % W]. So one register load is L rows x W consecutive bytes, and
the activations (x[k], .., x[k+W-1]) broadcast to every row feed the multiply directly:

- W = 2 (PAIRS): pmaddubsw (u8 x s8 -> adjacent pairs summed to s16), AVX2 (L = 16) or AVX-512BW (L = 32).
- W = 4 (QUADS): vpdpbusd (u8 x s8 -> 4 products summed into an s32 accumulator, no 16-bit step), AVX-512
  VNNI (L = 16) or AVX-VNNI (L = 8); on AVX2 (L = 8) and AVX-512BW (L = 16) pmaddubsw, its 16-bit sums
  widened by pmaddwd (`QuadSums`), for the formats whose weight bytes keep those exact (`MADDUBS_BYTE_MAX`).
  Only some formats have a quad emitter; the others keep pairs.

The `KernelSet` names the instructions (and so each format's layout); the Emitter's primitives (`maddubs`,
`pmaddwd`, `dpbusd`, `halves`) pick the instruction for it, or emit the same arithmetic as plain vector IR where
the set lacks it (exact too, slower).

An emitter handles one block of all ROWS rows of a group, L rows at a time, and adds its float32 results to
`acc` (ROWS,). Its arguments are LLVM values: flat arrays and element offsets computed by the caller:

    q     uint8   flat packed bytes; qo: offset of this block (q[g, b, 0, 0, 0, 0])
    s     uint16  flat packed half-floats; so: offset of s[g, b, 0, 0]
    xq    int8    flat quantized activations; a token's xo: offset of this block's first value
    dx    float32 activation scales per 32; xsum int32 (n/32, 2) flat: sums of xq per 16; a token's xb: first 32-block

and a list of tokens (`Token`): prefill runs `KernelSet.tile` tokens per call, each block's bytes loaded and
decoded once for all of them (pair kernels read xq2, which holds every activation pair twice, so a pair is one
32-bit broadcast load; see `xpair`). An emitter is written once for the list: a chunk's weight bytes are loaded and
decoded once and multiplied with every token's activations, each token adding into its own sums, with the same
float operations in the same order for any number of tokens: the multi-token kernels give the one-token results bit
for bit.

Integer sums are exact; the bounds that keep the 16-bit partial sums from saturating are noted at each pair
emitter (vpdpbusd has no 16-bit step). Every kernel set computes the same integer sums per row and block, and
the same float32 operations on them in the same order: the results are bit for bit the same on every CPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from llvmlite import ir
from numba import types
from numba.core import cgutils

from ..runtime import AVX2, AVX512_BW, AVX512_VNNI, AVX_VNNI, PORTABLE
from .fields import ROWS
from .spec import Format

PAIRS, QUADS = 2, 4  # bytes of a row side by side (W): for pmaddubsw, for vpdpbusd

# Products stream their weights from memory once, and the hardware prefetcher keeps a stream ahead only where
# the kernel reads a block's bytes in memory order. Each format's packed q is in the order its one-token kernel
# first reads it, and then no software request beats the hardware's: 16384 x 8192 matrices from memory (Zen 4,
# 2 threads, matvec against a plain read of the same bytes, alternating) streamed Q4_K at 0.98-1.00 of the read
# and Q6_K at 1.02-1.03 without software prefetches, 0.88 and 0.53-0.74 with one per line 16 KB ahead (prefetcht1;
# LLVM gathers a chunk's 36-52 requests at its start). A format whose kernel still reads several places of a
# block at once (`Format.prefetch`: Q3_K 0.23-0.34 of the read without, 0.74-0.81 with; Q5_K 0.32-0.44 and
# 0.80-0.82; Q2_K 0.50-0.52 and 0.48-0.67) asks L2 for each line this far ahead of its load. Those Zen 4 figures
# are of requests in a burst; spread beside their loads in the one-token kernels (`Emitter.prefetch`; Zen 5,
# 8960x1536, 2026-12-07): Q3_K 0.67 of the read in a burst, 0.84 spread; Q5_K 0.74 / 0.79; Q2_K 0.36 / 0.71.
PREFETCH_AHEAD = 16 << 10
# CPUs (LLVM's names) on which the hardware prefetcher stays behind even a one-token product read in memory order,
# and how far ahead its lines are asked for there (`KernelSet.in_order_ahead`). Zen 5 streams ~40 GB/s a core,
# where the Q4_K kernel computes at ~66 GB/s a core from L2: the waits for memory then add to the arithmetic
# instead of hiding under it. Cold matvecs, 2 threads, against a plain read of the same bytes (alternating, one
# process; 2026-12-07): Q4_K 8960x1536 0.64-0.75 of the read without, 0.80-0.81 with one request per line 8 KB
# ahead; 1536x8960 0.76 / 0.82; 16384x8192 0.75 / 0.81; 256x1536 0.73 / 0.86; Q6_K 8960x1536 0.68-0.69 / 0.74-0.78;
# 1536x8960 0.80 / 0.88 (4 KB ahead: the same for Q4_K, 0.64-0.74 for Q6_K; prefetcht0 or t2: no better). Those
# requests came in a burst at each chunk's start; spread beside their loads (`Emitter.prefetch`), 8 KB ahead
# against 2 and 4 (2026-12-07): Q4_K 8960x1536 0.96 / 0.88 / 0.89, 14336x4096 0.87 / 0.81 / 0.84, Q6_K 8960x1536
# 0.91 / 0.66 / 0.84, 4096x14336 0.93 / 0.80 / 0.93. Zen 1 (AMD EPYC family 23 model 1, the `avx2` set; its
# 256-bit arithmetic runs as two 128-bit halves, so its kernels compute at only ~17 GB/s from L3 with 2 threads):
# without requests the waits added to the arithmetic there too; 8960x1536, 2 threads, against a ~22 GB/s read
# (2026-12-07): Q4_K 11.3-11.7 GB/s without, 16.5-16.7 with requests 8 KB ahead (4 KB 15.1-16.5, 16 KB 14.8-16.0);
# Q6_K 10.2-10.4, 15.5-15.6 (4 KB 15.4-15.6, 16 KB 14.8-15.3). Other CPUs are not measured with spread requests.
IN_ORDER_PREFETCH_AHEAD = {"znver5": 8 << 10, "znver1": 8 << 10}
CACHE_LINE = 64
_PREFETCH_L2 = 2  # llvm.prefetch's locality: 2 is prefetcht1

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()

# pmaddubsw adds two u8 x s8 products into a saturating s16: exact for weight bytes up to 129 (2 * 129 * 127 <=
# 32767, x̂ in -127..127). Sets without vpdpbusd pack a format in quads only if its quad emitter stays below.
MADDUBS_BYTE_MAX = 129
_S16_MAX = 32767
_X_MAX = 127  # |x̂|: activations are quantized to -127..127

_VPDPBUSD = {(AVX512_VNNI, 16): "llvm.x86.avx512.vpdpbusd.512", (AVX_VNNI, 8): "llvm.x86.avx512.vpdpbusd.256"}
# instruction set: (rows per register of pairs, pmaddubsw's LLVM intrinsic)
_PMADDUBSW = {
    AVX512_VNNI: (32, "llvm.x86.avx512.pmaddubs.w.512"),
    AVX512_BW: (32, "llvm.x86.avx512.pmaddubs.w.512"),
    AVX_VNNI: (16, "llvm.x86.avx2.pmadd.ub.sw"),
    AVX2: (16, "llvm.x86.avx2.pmadd.ub.sw"),
}


def prefetch_l2(builder: ir.IRBuilder, ptr, off) -> None:
    """Emit a request to L2 for the cache line at ptr[off]: llvm.prefetch, a hint that never faults, even past
    the end of the array (the block kernels here and floats.py's products use it)."""
    i8p, i32 = I8.as_pointer(), ir.IntType(32)
    fn = builder.module.globals.get("llvm.prefetch.p0i8")
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8")
    read, data_cache = ir.Constant(i32, 0), ir.Constant(i32, 1)
    builder.call(fn, [builder.bitcast(builder.gep(ptr, [off]), i8p), read, ir.Constant(i32, _PREFETCH_L2), data_cache])


@dataclass(frozen=True)
class KernelSet:
    """The instructions the block kernels are emitted with, and so each format's packed layout."""

    isa: str  # engine.runtime's name: AVX512_VNNI, AVX_VNNI, AVX512_BW, AVX2 or PORTABLE
    vector_bytes: int  # one register: 64 (zmm) or 32 (ymm; plain vector IR for PORTABLE)
    quad_codes: frozenset[int]  # formats packed in quads (vpdpbusd, or pmaddubsw by `QuadSums`); the others in pairs
    f16c: bool  # half -> float in one instruction (vcvtph2ps); else integer bit moves
    in_order_ahead: int = 0  # bytes ahead the one-token kernels ask for lines of formats read in order (0: never)

    @property
    def tile(self) -> int:
        """Tokens per multi-token kernel call (prefill), bounded by the vector registers: a token holds one or
        two accumulators and its float sums live in the inner loop, besides the decoded bytes and the masks.
        With AVX2's 16 YMM registers, 4 measured faster than 2 for every format (Zen 3), and 4 tokens sharing one
        decode faster than two passes of 2 for Q4_K and Q6_K. AVX-512's 32 hold 8: over Qwen2.5-1.5B's prompt
        products (256 tokens; Intel Xeon, 2 threads, one run each) Q4_K went from 363 to 388 GOPS and Q6_K from
        271 to 308 against 4."""
        return 8 if self.vector_bytes == 64 else 4

    def layout(self, code: int) -> tuple[int, int]:
        """(L rows per register, W bytes of a row side by side) of format `code`'s packed q."""
        width = QUADS if code in self.quad_codes else PAIRS
        return self.vector_bytes // width, width


def vt(elt: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elt, n)


def splat_const(elt: ir.Type, n: int, value) -> ir.Constant:
    return ir.Constant(vt(elt, n), [value] * n)


def halves_to_floats(b: ir.IRBuilder, h, f16c: bool):
    """<n x i16> of half-float bit patterns -> <n x float>: vcvtph2ps with F16C, else exact integer moves."""
    n = h.type.count
    if f16c:
        return b.fpext(b.bitcast(h, vt(F16, n)), vt(F32, n))
    v = b.zext(h, vt(I32, n))  # as fields.h2f: sign and magnitude moved into place, times 2**112
    mag = b.shl(b.and_(v, splat_const(I32, n, 0x7FFF)), splat_const(I32, n, 13))
    bits = b.or_(mag, b.shl(b.and_(v, splat_const(I32, n, 0x8000)), splat_const(I32, n, 16)))
    finite = b.fmul(b.bitcast(bits, vt(F32, n)), splat_const(F32, n, 2.0**112))
    special = b.bitcast(b.or_(bits, splat_const(I32, n, 0x7F800000)), vt(F32, n))
    exp31 = b.icmp_unsigned("==", b.and_(v, splat_const(I32, n, 0x7C00)), splat_const(I32, n, 0x7C00))
    return b.select(exp31, special, finite)


@dataclass(frozen=True)
class Token:
    """Where one token's operands are: xo, xb as in the module docstring, ao the offset of its ROWS results in acc."""

    xo: ir.Value
    xb: ir.Value
    ao: int
    doubled: bool = False  # xq holds every pair twice (`xpair`)


class Emitter:
    """Small helpers over an IRBuilder, for the kernels below: L rows per register, W bytes of each."""

    def __init__(self, context, builder, signature, args, fmt: Format, kernels: KernelSet, one_token: bool):
        self.b = builder
        self.k = kernels
        self.L, self.W = kernels.layout(fmt.code)
        self.quad_byte_max = fmt.quad_byte_max  # the largest weight byte the format's quad emitter multiplies
        self.chunk_bytes = fmt.packing.quant_bytes * self.L  # bytes of one L-row chunk of a block
        # how far ahead `qvec` asks L2 for each line (0: not at all)
        self.prefetch_ahead = PREFETCH_AHEAD if fmt.prefetch else kernels.in_order_ahead if one_token else 0
        self.one_token = one_token
        self._fetched_lines: set[int] = set()  # lines of the current chunk already asked for (`qvec`)
        self.vals = []
        for ty, a in zip(signature.args, args, strict=True):
            if isinstance(ty, types.Array):
                self.vals.append(context.make_array(ty)(context, builder, a).data)
            elif isinstance(ty, types.Integer) and ty.bitwidth != 64:
                self.vals.append(builder.sext(a, I64) if ty.signed else builder.zext(a, I64))
            else:
                self.vals.append(a)

    @property
    def has_dpbusd(self) -> bool:
        """Whether this layout's quads multiply with vpdpbusd (else pmaddubsw: `QuadSums`)."""
        return (self.k.isa, self.L) in _VPDPBUSD

    def at(self, base, k: int):
        return self.b.add(base, ir.Constant(I64, k)) if k else base

    @contextmanager
    def chunks(self):
        """Loop over the ROWS / L slices of the group (a loop, not unrolled: it keeps compiles short)."""
        with cgutils.for_range(self.b, ir.Constant(I64, ROWS // self.L)) as loop:
            self._fetched_lines = set()
            yield loop.index

    def zero16(self):
        return splat_const(I16, self.L, 0)

    def zero32(self):
        return splat_const(I32, self.L, 0)

    def qvec(self, q, qo, c, j: int):
        """<L*W x i8>: bytes W*j .. W*j + W-1 of the L rows of chunk c (q[g, b, c, j, :, :])."""
        start = j * self.W * self.L
        off = self.b.add(self.at(qo, start), self.b.mul(c, ir.Constant(I64, self.chunk_bytes)))
        line = start // CACHE_LINE  # one request per line of the chunk: AVX2 loads half a line, some bytes twice
        if self.prefetch_ahead and line not in self._fetched_lines:
            self._fetched_lines.add(line)
            self.prefetch(q, self.at(off, self.prefetch_ahead))
        return self.load(q, off, I8, self.W * self.L)

    def reload_barrier(self) -> None:
        """Loads after this point read memory again instead of reusing earlier loads of the same bytes.

        Reloading a chunk's bytes from L1 costs one load; keeping them live from one pass over the chunk to the
        next costs registers that AVX2's 16 cannot spare, and LLVM then spills and reloads them (a store and a
        load each).
        """
        fn = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", side_effect=True)
        self.b.call(fn, [])

    def stash(self, values: list) -> ir.Value:
        """Store scalars of one type in a stack array whose address escapes (into an empty asm), and return it.

        A loop then reads each with one broadcast load (`unstash`). Left as values, LLVM hoists their splats
        out of the loop and holds them all in vector registers, which spills when a tile has dozens.
        """
        elt = values[0].type
        arr = cgutils.alloca_once(self.b, elt, size=len(values))
        for i, v in enumerate(values):
            self.b.store(v, self.b.gep(arr, [ir.Constant(I32, i)]))
        escape = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [elt.as_pointer()]), "", "r,~{memory}", side_effect=True)
        self.b.call(escape, [arr])
        return arr

    def unstash(self, arr, i: int):
        """Scalar i of a `stash`, splat to L lanes."""
        return self.splat(self.b.load(self.b.gep(arr, [ir.Constant(I32, i)])), self.L)

    def prefetch(self, ptr, off) -> None:
        """Ask L2 for the line at ptr[off] (never faults, even past the array's end).

        In a one-token kernel each request stays beside the load it runs ahead of, pinned there by an empty asm
        statement: left free, LLVM's scheduler issues a chunk's 36-52 requests in one burst at its start, and
        the core then waits on memory and computes by turns instead of both at once. Cold matvecs, Zen 5, 2
        threads, against a plain read (2026-12-07): Q4_K 8960x1536 0.70-0.75 of the read in a burst, 0.90-0.95
        spread; Q6_K 1536x8960 0.83 and 0.99-1.01. Prompt tiles keep the burst: they compute far longer than
        they wait, and the pins cost their scheduling (one token from L2: Q4_K 61 -> 53 GB/s).
        """
        if self.one_token:
            self.b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "", "", side_effect=True), [])
        prefetch_l2(self.b, ptr, off)

    def qpair(self, q, qo, c, jp: int):
        """<2L x i8>: byte pair jp of the L rows of chunk c (pair layout)."""
        return self.qvec(q, qo, c, jp)

    def qpair16(self, q, qo, c, jp: int):
        """The same as L little-endian 16-bit words."""
        return self.b.bitcast(self.qpair(q, qo, c, jp), vt(I16, self.L))

    def qquad32(self, q, qo, c, jq: int):
        """Quad jq of the L rows as L little-endian 32-bit words (quad layout)."""
        return self.b.bitcast(self.qvec(q, qo, c, jq), vt(I32, self.L))

    def rows(self, base, c, k: int = 0):
        """Offset of field k (k * ROWS) of chunk c's rows in an s-like array."""
        return self.b.add(self.at(base, k * ROWS), self.b.mul(c, ir.Constant(I64, self.L)))

    def load(self, ptr, off, elt: ir.Type, n: int):
        p = self.b.bitcast(self.b.gep(ptr, [off]), vt(elt, n).as_pointer())
        return self.b.load(p, align=1)

    def load_scalar(self, ptr, off):
        return self.b.load(self.b.gep(ptr, [off]))

    def store(self, ptr, off, v):
        p = self.b.bitcast(self.b.gep(ptr, [off]), v.type.as_pointer())
        self.b.store(v, p, align=1)

    def splat(self, scalar, n: int):
        t = vt(scalar.type, n)
        v = self.b.insert_element(ir.Constant(t, ir.Undefined), scalar, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(t, ir.Undefined), ir.Constant(vt(I32, n), [0] * n))

    def shuffle(self, v, idx: list[int]):
        return self.b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(vt(I32, len(idx)), idx))

    def concat(self, a, c):
        n = a.type.count
        return self.b.shuffle_vector(a, c, ir.Constant(vt(I32, 2 * n), list(range(2 * n))))

    def pair(self, xq, off):
        """The bytes (xq[off], xq[off + 1]) repeated for L rows: <2L x i8>."""
        p = self.b.bitcast(self.b.gep(xq, [off]), I16.as_pointer())
        return self.b.bitcast(self.splat(self.b.load(p, align=1), self.L), vt(I8, 2 * self.L))

    def xpair(self, xq, tok: Token, k: int):
        """Token tok's activation pair (k, k + 1) of its block, repeated for L rows: <2L x i8>.

        With tok.doubled, xq holds each pair twice (4 bytes, value k at byte 2k) and one 32-bit broadcast
        load fetches it: no shuffle, as the 16-bit broadcast of `pair` takes.
        """
        off = self.at(tok.xo, k)
        if not tok.doubled:
            return self.pair(xq, off)
        p = self.b.bitcast(self.b.gep(xq, [self.b.mul(off, ir.Constant(I64, 2))]), I32.as_pointer())
        return self.b.bitcast(self.splat(self.b.load(p, align=1), self.L // 2), vt(I8, 2 * self.L))

    def xquad(self, xq, tok: Token, k: int):
        """Token tok's activations k .. k + 3 of its block, repeated for L rows: <4L x i8> (quad layout)."""
        p = self.b.bitcast(self.b.gep(xq, [self.at(tok.xo, k)]), I32.as_pointer())
        return self.b.bitcast(self.splat(self.b.load(p, align=1), self.L), vt(I8, 4 * self.L))

    def nibbles(self, v, high: bool):
        """Low or high nibble of every byte of v <n x i8>."""
        n = v.type.count
        if high:  # no byte shift on x86: shift the 16-bit lanes, then mask
            v = self.b.bitcast(self.b.lshr(self.b.bitcast(v, vt(I16, n // 2)), splat_const(I16, n // 2, 4)), v.type)
        return self.b.and_(v, splat_const(I8, n, 15))

    def lookup16(self, v, table: tuple[int, ...]):
        """table[v] for every byte of v <n x i8>, each 0..15 (a 16-entry codebook, IQ4_NL's): pshufb, the table
        repeated in every 128-bit lane, or where the set lacks it (portable) a tree of selects on the index bits."""
        n = v.type.count
        entries = [t - 256 if t > 127 else t for t in table]  # as i8
        if self.k.isa != PORTABLE and n == self.k.vector_bytes and n in (32, 64):
            name = "llvm.x86.avx2.pshuf.b" if n == 32 else "llvm.x86.avx512.pshuf.b.512"
            tab = ir.Constant(vt(I8, n), [entries[i % 16] for i in range(n)])
            return self.b.call(self._intrinsic(name, vt(I8, n), [vt(I8, n)] * 2), [tab, v])
        out = [splat_const(I8, n, t) for t in entries]
        for bit in range(4):  # halve the candidates on each index bit, lowest first
            set_ = self.b.icmp_unsigned("!=", self.b.and_(v, splat_const(I8, n, 1 << bit)), splat_const(I8, n, 0))
            out = [self.b.select(set_, out[2 * i + 1], out[2 * i]) for i in range(len(out) // 2)]
        return out[0]

    def bits16(self, h, shift: int, mask: int):
        """(h << shift) & mask per 16-bit lane for shift >= 0, (h >> -shift) & mask otherwise; as <2L x i8>."""
        if shift > 0:
            h = self.b.shl(h, splat_const(I16, self.L, shift))
        elif shift < 0:
            h = self.b.lshr(h, splat_const(I16, self.L, -shift))
        return self.b.bitcast(self.b.and_(h, splat_const(I16, self.L, mask)), vt(I8, 2 * self.L))

    def bits32(self, h, shift: int, mask: int):
        """bits16 for the quad layout: per 32-bit lane, as <4L x i8>."""
        if shift > 0:
            h = self.b.shl(h, splat_const(I32, self.L, shift))
        elif shift < 0:
            h = self.b.lshr(h, splat_const(I32, self.L, -shift))
        return self.b.bitcast(self.b.and_(h, splat_const(I32, self.L, mask)), vt(I8, 4 * self.L))

    def byte_of(self, w32, i: int, signed: bool):
        """Byte i of every 32-bit lane of w32 <L x i32>, zero- or sign-extended to i32."""
        if signed:
            return self.b.ashr(self.b.shl(w32, splat_const(I32, self.L, 24 - 8 * i)), splat_const(I32, self.L, 24))
        if i:
            w32 = self.b.lshr(w32, splat_const(I32, self.L, 8 * i))
        return self.b.and_(w32, splat_const(I32, self.L, 255))

    def _intrinsic(self, name: str, ret: ir.Type, args: list[ir.Type]):
        fn = self.b.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.b.module, ir.FunctionType(ret, args), name)
        return fn

    def maddubs(self, a, x):
        """<2n x i8> unsigned a, signed x -> <n x i16>: a[2i]x[2i] + a[2i+1]x[2i+1], saturated (pmaddubsw).
        A register of pairs gives n = L, one of quads 2L (two sums per row)."""
        n = a.type.count // 2
        lanes, name = _PMADDUBSW.get(self.k.isa, (0, ""))
        if n == lanes:
            return self.b.call(self._intrinsic(name, vt(I16, n), [vt(I8, 2 * n)] * 2), [a, x])
        t32 = vt(I32, n)
        even, odd = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
        p = self.b.add(
            self.b.mul(self.b.zext(self.shuffle(a, even), t32), self.b.sext(self.shuffle(x, even), t32)),
            self.b.mul(self.b.zext(self.shuffle(a, odd), t32), self.b.sext(self.shuffle(x, odd), t32)),
        )
        lo, hi = splat_const(I32, n, -32768), splat_const(I32, n, 32767)
        p = self.b.select(self.b.icmp_signed(">", p, lo), p, lo)
        p = self.b.select(self.b.icmp_signed("<", p, hi), p, hi)
        return self.b.trunc(p, vt(I16, n))

    def pmaddwd(self, a, x):
        """<n x i16> a, x -> <n/2 x i32>: a[2i]x[2i] + a[2i+1]x[2i+1] (pmaddwd; cannot overflow)."""
        n = a.type.count
        name = None
        if self.k.isa != PORTABLE and n == 16:
            name = "llvm.x86.avx2.pmadd.wd"
        elif self.k.isa in (AVX512_BW, AVX512_VNNI) and n == 32:
            name = "llvm.x86.avx512.pmaddw.d.512"
        if name is not None:
            return self.b.call(self._intrinsic(name, vt(I32, n // 2), [vt(I16, n)] * 2), [a, x])
        t32 = vt(I32, n // 2)
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
            t = vt(I32, n)
            fn = self._intrinsic(name, t, [t, t, t])
            return self.b.call(fn, [acc, self.b.bitcast(a, t), self.b.bitcast(x, t)])
        t32 = vt(I32, n)
        for j in range(4):
            idx = list(range(j, 4 * n, 4))
            prod = self.b.mul(self.b.zext(self.shuffle(a, idx), t32), self.b.sext(self.shuffle(x, idx), t32))
            acc = self.b.add(acc, prod)
        return acc

    def by_parity(self, v16):
        """<L x i16> per-row factors -> (even rows', odd rows'), the other lanes zeroed: for `scaled_sums`."""
        n = self.L
        z = splat_const(I16, n, 0)
        even = [r if r % 2 == 0 else n + r for r in range(n)]
        odd = [n + r if r % 2 == 0 else r for r in range(n)]
        sel = self.b.shuffle_vector
        return sel(v16, z, ir.Constant(vt(I32, n), even)), sel(v16, z, ir.Constant(vt(I32, n), odd))

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
        return self.b.sext(v16, vt(I32, self.L))

    def even_odd_bytes(self, v):
        """<2L x i8> of L rows' byte pairs -> (first bytes, second bytes), each <L x i8>."""
        n = 2 * self.L
        return self.shuffle(v, list(range(0, n, 2))), self.shuffle(v, list(range(1, n, 2)))

    def halves(self, s, off):
        """L rows' half-floats at s[off] as <L x float>: vcvtph2ps with F16C, else exact integer moves."""
        return halves_to_floats(self.b, self.load(s, off, I16, self.L), self.k.f16c)

    def bf16s(self, s, off):
        """L rows' bfloat16 fields at s[off] as <L x float>: exact, the 16 bits moved to the top of a float's."""
        n = self.L
        h = self.b.zext(self.load(s, off, I16, n), vt(I32, n))
        return self.b.bitcast(self.b.shl(h, splat_const(I32, n, 16)), vt(F32, n))

    def fsplat(self, f):
        return self.splat(f, self.L)

    def to_float(self, i32v):
        return self.b.sitofp(i32v, vt(F32, self.L))

    def add_to_acc(self, acc, tok: Token, c, v):
        """acc[tok.ao + Lc : tok.ao + Lc + L] += v."""
        off = self.at(self.b.mul(c, ir.Constant(I64, self.L)), tok.ao)
        self.store(acc, off, self.b.fadd(self.load(acc, off, F32, self.L), v))


def xsum32(e: Emitter, xsum, xb):
    """Sum of xq over the 32-block xb (two 16-sums), as i32."""
    i = e.b.mul(xb, ir.Constant(I64, 2))
    return e.b.add(e.load_scalar(xsum, i), e.load_scalar(xsum, e.at(i, 1)))


class QuadSums:
    """Integer sums of quads of products, one <L x i32> per chain: sum over the chain's (v, x) of the four
    products v[4r + m] * x[4r + m] of each row r (v unsigned weight bytes, x signed activations, <4L x i8>).

    With vpdpbusd, one instruction a quad. Without it, pmaddubsw into 16-bit sums (two a row), as many quads as
    the format's largest byte keeps exact, then pmaddwd by ones: both sums of a row added into 32 bits. The
    integers are the same either way, so every kernel set goes on with the same float operations.
    """

    def __init__(self, e: Emitter, chains: int):
        self.e = e
        self.dpbusd = e.has_dpbusd
        self.wide = [e.zero32()] * chains
        if not self.dpbusd:
            if e.quad_byte_max > MADDUBS_BYTE_MAX:
                raise ValueError(f"quad bytes up to {e.quad_byte_max} saturate pmaddubsw")
            self.per_narrow = _S16_MAX // (2 * _X_MAX * e.quad_byte_max)  # quads per 16-bit sum
            self.narrow = [splat_const(I16, 2 * e.L, 0)] * chains
            self.count = [0] * chains

    def add(self, i: int, v, x) -> None:
        """Chain i += the products of quad v and activations x."""
        e = self.e
        if self.dpbusd:
            self.wide[i] = e.dpbusd(self.wide[i], v, x)
            return
        self.narrow[i] = e.b.add(self.narrow[i], e.maddubs(v, x))
        self.count[i] += 1
        if self.count[i] == self.per_narrow:
            self._widen(i)

    def _widen(self, i: int) -> None:
        e = self.e
        ones = splat_const(I16, 2 * e.L, 1)
        self.wide[i] = e.b.add(self.wide[i], e.pmaddwd(self.narrow[i], ones))
        self.narrow[i] = splat_const(I16, 2 * e.L, 0)
        self.count[i] = 0

    def result(self, i: int):
        """Chain i's sum, <L x i32>."""
        if not self.dpbusd and self.count[i]:
            self._widen(i)
        return self.wide[i]


def dot_runs(e: Emitter, toks: list[Token], xq, quads, chains: int = 4) -> list:
    """Per token, sum over (v, k) in quads of the products of v and x̂[k : k + 4] (`QuadSums`): <L x i32>.

    vpdpbusd adds into its accumulator (4-5 cycles a step): up to `chains` chains of accumulators take turns, so
    that consecutive steps do not wait on each other, at the cost of the adds that join them. Several tokens are
    several chains already: four tokens with four accumulators each would hold 16 registers and spill. So are
    several runs summed apart (pass chains=1). pmaddubsw's chains wait only on a 16-bit add.
    """
    chains = max(1, min(chains, len(quads)) // len(toks)) if e.has_dpbusd else 1
    sums = QuadSums(e, chains * len(toks))
    for n, (v, k) in enumerate(quads):
        for i, t in enumerate(toks):
            sums.add(i * chains + n % chains, v, e.xquad(xq, t, k))
    out = []
    for i in range(len(toks)):
        a = [sums.result(i * chains + j) for j in range(chains)]
        while len(a) > 1:  # a pairwise tree: exact in integers, whatever the order
            a = [e.b.add(a[j], a[j + 1]) if j + 1 < len(a) else a[j] for j in range(0, len(a), 2)]
        out.append(a[0])
    return out


class RunBiases:
    """bias · sum(x̂) over every run of a block's values, per token: the term a format storing values + bias
    (Q3_K: 4, Q6_K: 32 over runs of 16; IQ4_XS: 128 over 32) takes off each run's integer sum. Computed once
    a block, before the chunk loop; a tile's are read back from the stack (`Emitter.stash`)."""

    def __init__(self, e: Emitter, toks: list[Token], xsum, runs: int, bias: int, run: int = 16):
        self.e, self.runs = e, runs
        b, two = e.b, ir.Constant(I64, 2)
        if run == 16:  # run r: half r % 2 of 32-block r // 2
            sums = [[e.load_scalar(xsum, e.at(b.mul(t.xb, two), r)) for r in range(runs)] for t in toks]
        else:
            sums = [[xsum32(e, xsum, e.at(t.xb, r)) for r in range(runs)] for t in toks]
        self.values = [b.mul(v, ir.Constant(I32, bias)) for row in sums for v in row]
        self.stash = e.stash(self.values) if len(toks) > 1 else None

    def __call__(self, i: int, run: int):
        """Token i's bias sum of run `run`, splat to L lanes."""
        k = i * self.runs + run
        return self.e.unstash(self.stash, k) if self.stash is not None else self.e.splat(self.values[k], self.e.L)


def add_centred_run(e: Emitter, fd: list, isums: list, toks: list[Token], dx, block: int, h: int, biases: RunBiases,
                    scale) -> None:  # fmt: skip
    """fd[i] += dx · float((isums[i] - bias · sum(x̂)) · scale) for each token's 16-value run h of 32-block
    `block`: a run of values stored as value + bias, the bias taken off the integer sum before the per-row
    scale <L x i32>, so that every kernel set computes the same integer."""
    run = 2 * block + h
    centred_products(e, fd, [e.b.sub(isums[i], biases(i, run)) for i in range(len(toks))], toks, dx, block, scale)


def centred_products(e: Emitter, fd: list, centred: list, toks: list[Token], dx, block: int, scale) -> None:
    """fd[i] += dx · float(centred[i] · scale) for each token, with dx that of 32-block `block`: the product taken
    in floats, one instruction against vpmulld's two. float(n) · float(scale) is float(n · scale) exactly: both
    factors are integers under 2^24 in magnitude, and either way is one rounding of the same exact product."""
    b = e.b
    fscale = e.to_float(scale)
    for i, t in enumerate(toks):
        d_x = e.fsplat(e.load_scalar(dx, e.at(t.xb, block)))
        fd[i] = b.fadd(fd[i], b.fmul(d_x, b.fmul(e.to_float(centred[i]), fscale)))
