"""The block kernels for this CPU: every format's SIMD emitters turned into intrinsics, and the dispatch over them.

Numba's auto-vectorized loops over the packed layout reach ~1 byte of weights per vector instruction: every
nibble is widened to 32 bits and multiplied alone. The kernels written as LLVM vector IR keep bytes as bytes and
multiply them in groups with one instruction: each format's emitters (engine/formats/<type>.py, written with
the toolkit in engine/formats/emit.py) emit them, per instruction family (W = PAIRS for pmaddubsw, QUADS for
vpdpbusd), and `build_kernels` wraps them as intrinsics (`numba.extending.intrinsic`) for one `KernelSet`.

Which instructions, and so which layout per format, is the KernelSet chosen from the compile target's CPU
features (`kernel_set`, from engine.runtime.chosen_isa: the CPU's best, or a lesser set that CHATAPP_KERNEL_SET
names): Numba compiles for the host CPU (or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES), and the kernel cache folder is
keyed on the same features and set, so a kernel emitted for one instruction set never runs on another CPU.
Without AVX2 the same arithmetic is emitted as plain vector IR (exact too, slower).

The intrinsics, per format:
- block(q, qo, s, so, xq, xo, dx, xsum, xb, acc): acc (ROWS,) += W[group] @ x̂ over one block, one token.
- block_tile(q, qo, s, so, xq, xq2, xo, xstep, dx, xsum, xb, bstep, acc): the same for TILE tokens at once,
  token t's operands at xo + t*xstep (in xq, or for pair kernels in xq2: every pair twice) and xb + t*bstep
  (dx, xsum), its results in acc[t*ROWS : (t+1)*ROWS].
`BLOCKS` and `BLOCKS_TILE` loop one format's kernel over a group's blocks, picked by the format's tag
(formats.dispatch.by_format) when the caller is compiled (packed.group_simd and group_simd_tile call them).
"""

from __future__ import annotations

import os

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ..formats import QUANTIZED, Format
from ..formats.dispatch import by_format
from ..formats.emit import I64, IN_ORDER_PREFETCH_AHEAD, MADDUBS_BYTE_MAX, PAIRS, QUADS, Emitter, KernelSet, Token
from ..formats.fields import ROWS
from ..formats.spec import Kernel
from ..runtime import AVX2, AVX512_BW, AVX512_VNNI, AVX_VNNI, PORTABLE, chosen_isa, compile_target

__all__ = ["KERNELS", "QUAD_CODES", "ROWS", "TILE", "KernelSet", "build_kernels", "kernel_set"]

QUAD_CODES = frozenset(f.code for f in QUANTIZED.values() if QUADS in f.emitters)  # formats with a quad kernel
# those whose quad kernel pmaddubsw multiplies exactly, for the sets without vpdpbusd
MADDUBS_QUAD_CODES = frozenset(
    f.code for f in QUANTIZED.values() if QUADS in f.emitters and f.quad_byte_max <= MADDUBS_BYTE_MAX
)


def kernel_set(isa: str, f16c: bool = True, cpu: str = "") -> KernelSet:
    """The kernel set for an instruction set name (engine.runtime.kernel_isa), on the CPU LLVM names `cpu`."""
    wide = isa in (AVX512_BW, AVX512_VNNI)
    quads = {AVX512_VNNI: QUAD_CODES, AVX_VNNI: QUAD_CODES, AVX512_BW: MADDUBS_QUAD_CODES, AVX2: MADDUBS_QUAD_CODES}
    quads = quads.get(isa, frozenset())
    if isa not in (AVX512_VNNI, AVX_VNNI, AVX512_BW, AVX2, PORTABLE):
        raise ValueError(f"unknown instruction set {isa!r}")
    return KernelSet(isa, 64 if wide else 32, quads, f16c, IN_ORDER_PREFETCH_AHEAD.get(cpu, 0))


# The CPU Numba compiles for (the host's, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES), found as Numba finds it.
TARGET_NAME, TARGET_FEATURES = compile_target(os.environ)
KERNELS = kernel_set(chosen_isa(os.environ, TARGET_FEATURES), "f16c" in TARGET_FEATURES, TARGET_NAME)
TILE = KERNELS.tile  # tokens per multi-token kernel call; another set built here (`build_kernels`) uses it too


def _emitter(context, builder, signature, args, fmt: Format, kernels: KernelSet, one_token: bool):
    """(emitter, the format's emit function for the width this set packs it in)."""
    e = Emitter(context, builder, signature, args, fmt, kernels, one_token)
    return e, fmt.emitters[e.W]


def _one(fmt: Format, kernels: KernelSet):
    def codegen(context, builder, signature, args):
        e, emit = _emitter(context, builder, signature, args, fmt, kernels, one_token=True)
        q, qo, s, so, xq, xo, dx, xsum, xb, acc = e.vals
        emit(e, q, qo, s, so, xq, dx, xsum, acc, [Token(xo, xb, 0)])
        return context.get_dummy_value()

    def kernel(typingctx, q, qo, s, so, xq, xo, dx, xsum, xb, acc):
        return types.void(q, qo, s, so, xq, xo, dx, xsum, xb, acc), codegen

    kind = "super-block" if fmt.block > 32 else "block"
    kernel.__name__ = kernel.__qualname__ = f"block_{fmt.type.name.lower()}"
    kernel.__doc__ = f"acc += W[group] @ x̂ over one {fmt.type.name} {kind}."
    return intrinsic(kernel)


def _tile(fmt: Format, kernels: KernelSet):
    def codegen(context, builder, signature, args):
        e, emit = _emitter(context, builder, signature, args, fmt, kernels, one_token=False)
        q, qo, s, so, xq, xq2, xo, xstep, dx, xsum, xb, bstep, acc = e.vals
        b = e.b
        doubled = e.W == PAIRS  # pair kernels broadcast a pair from xq2 in one 32-bit load
        toks = [
            Token(
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

    kernel.__name__ = kernel.__qualname__ = f"block_{fmt.type.name.lower()}_tile"
    kernel.__doc__ = f"block_{fmt.type.name.lower()} for TILE tokens at once."
    return intrinsic(kernel)


def _blocks(kernel, fmt: Format) -> Kernel:
    """One token's `kernel` over the nb blocks of a group: block b at q0 + b*qstep, s0 + b*sstep."""
    block, per = fmt.block, fmt.block // 32  # values, and 32-blocks of x, per block

    @njit(inline="always", nogil=True)
    def blocks(qf, q0, qstep, sf, s0, sstep, xf, dx, xsf, nb, acc):
        for b in range(nb):
            kernel(qf, q0 + b * qstep, sf, s0 + b * sstep, xf, b * block, dx, xsf, b * per, acc)

    return blocks


def _blocks_tile(kernel, fmt: Format) -> Kernel:
    """TILE tokens' `kernel` over the nb blocks of a group (x0, b0: the first token's value and 32-block)."""
    block, per = fmt.block, fmt.block // 32

    @njit(inline="always", nogil=True)
    def blocks(qf, q0, qstep, sf, s0, sstep, xf, xf2, x0, n, dxf, xsf, b0, nx, af, nb):
        for b in range(nb):
            so = s0 + b * sstep
            kernel(qf, q0 + b * qstep, sf, so, xf, xf2, x0 + b * block, n, dxf, xsf, b0 + b * per, nx, af)

    return blocks


def build_kernels(kernels: KernelSet) -> tuple[Kernel, Kernel]:
    """(blocks, blocks_tile): every format's kernels emitted with `kernels`, each looped over a group's blocks,
    picked by the format's tag (see the module docstring for their arguments).

    The module's own BLOCKS, BLOCKS_TILE are KERNELS's; another set runs only where its instructions exist, on
    weights packed in its layout (benchmarks compare kernel sets in one process this way).
    """
    one = {f.code: _blocks(_one(f, kernels), f) for f in QUANTIZED.values()}
    tile = {f.code: _blocks_tile(_tile(f, kernels), f) for f in QUANTIZED.values()}
    one_params = "qf, q0, qstep, sf, s0, sstep, xf, dx, xsf, nb, acc"
    tile_params = "qf, q0, qstep, sf, s0, sstep, xf, xf2, x0, n, dxf, xsf, b0, nx, af, nb"
    return by_format(one, one_params), by_format(tile, tile_params)


BLOCKS, BLOCKS_TILE = build_kernels(KERNELS)
