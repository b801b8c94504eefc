"""What a format module declares: its `Format` record, which the registry (this package's __init__) reads.

Modelled on gguf-py's quants.py (one class per type, registered by its type) and ggml's `type_traits`: the
kernels never name a type; they run whatever the records provide, through dispatch the registry generates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

Kernel = Any  # a Numba dispatcher (njit, inline="always")


@dataclass(frozen=True)
class Packing:
    """How a block is regrouped for the packed kernels (engine/kernels/packed.py): its q bytes and s fields."""

    quant_bytes: int  # QB: bytes per block in q
    copies: tuple[tuple[int, int, int], ...]  # (raw offset, q offset, count): bytes moved as they are
    halves: tuple[int, ...]  # raw offsets of the 16-bit fields moved to s (half-float scales, Q5's qh)
    # repack(row, o, q, s, g, b, r): the fields not moved as they are, for row g*ROWS + r (its file bytes row,
    # block at o) into block b, after the copies; unpack(q, s, g, b, r, out, o): their inverse into out[o:].
    repack: Kernel | None = None
    unpack: Kernel | None = None
    filled: int = 0  # s fields after the halves that `repack` fills (MXFP4's scale, from its E8M0 byte)

    @property
    def s_fields(self) -> int:
        """NS: the 16-bit fields per block in s."""
        return len(self.halves) + self.filled


def ordered_copies(order: Sequence[int], raw_start: int = 0) -> tuple[tuple[int, int, int], ...]:
    """`Packing.copies` that put a block's quads (4-byte words; quad j at raw_start + 4j in the file) in q in
    the given order: order[p] is the quad at q offset 4p. Quads adjacent in both are one copy."""
    copies: list[list[int]] = []
    for p, j in enumerate(order):
        if copies and copies[-1][0] + copies[-1][2] == raw_start + 4 * j:
            copies[-1][2] += 4
        else:
            copies.append([raw_start + 4 * j, 4 * p, 4])
    return tuple(tuple(c) for c in copies)  # type: ignore[misc]


@dataclass(frozen=True)
class Format:
    """One ggml type: its layout (from gguf), its dequantizers, and for block formats its CPU kernels."""

    type: T
    dequantize: Callable[..., Any]  # dequantize(xp, b uint8 (n, block_bytes)) -> float32 (n, block): any array module
    deq: Kernel | None = None  # deq(row, o, f16, out, p): the block at row[o:] -> out[p : p + block]
    dot: Kernel | None = None  # dot(row, o, f16, x, p) -> sum(block * x[p:]); None: via deq
    packing: Packing | None = None
    group: Kernel | None = None  # group(q, s, g, xq, dx, xsum, acc): the packed kernel as plain loops
    emitters: Mapping[int, Callable[..., None]] = field(default_factory=dict)  # W (emit.PAIRS, QUADS) -> emitter
    # The largest weight byte the quad emitter multiplies: kernel sets without vpdpbusd (pmaddubsw, which
    # saturates in 16 bits) pack the format in quads only where it is small enough (emit.MADDUBS_BYTE_MAX).
    quad_byte_max: int = 255
    # The one-token kernel reads several places of a block at once, out of memory order: the hardware prefetcher
    # loses the stream, and each load asks for its line ahead in software instead (emit.PREFETCH_AHEAD).
    prefetch: bool = False
    # quantize(x float32 (n, cols)) -> uint8 (n, row_bytes): ggml's reference quantizer, to re-encode a draft
    # model's weights at load (engine/requantize.py); None where nothing needs it.
    quantize: Callable[[Any], Any] | None = None

    @property
    def code(self) -> int:
        """ggml's type id (the compiled kernels take its tag, dispatch.tag(code))."""
        return int(self.type)

    @property
    def block(self) -> int:
        """Values per block."""
        return GGML_QUANT_SIZES[self.type][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.type][1]
