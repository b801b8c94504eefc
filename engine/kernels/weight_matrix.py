"""The weight wrapper: a matrix kept in its file encoding (`WeightMatrix`), and its copy repacked for the
block kernels (`PackedWeight`, packed.py), built on the first product; with the dequantizing of its rows to float32.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as T

from ..formats import FORMATS, QUANTIZED, bf16, f16, f32
from ..formats.dispatch import tag
from ..formats.fields import F16_TABLE
from . import cpu, packed, pages

BLOCK_CODES = {t: f.code for t, f in QUANTIZED.items()}  # each block format's ggml type -> its dispatch code
FLOAT_TYPES = (f32.TYPE, f16.TYPE, bf16.TYPE)
HALF_TYPES = (f16.TYPE, bf16.TYPE)  # 16-bit floats: products in floats.py
FLOAT_VALUES = {m.TYPE: m.values for m in (f32, f16, bf16)}  # stored data -> float32
SUPPORTED_TYPES = frozenset(BLOCK_CODES) | frozenset(FLOAT_TYPES)
# Types with a repacked decode kernel; the others keep the per-row kernels of cpu.py.
PACKED_TYPES = frozenset(t for t, code in BLOCK_CODES.items() if code in packed.PACKED_CODES)

# Weights are packed this many file bytes at a time, each slice's file pages released before the next.
_PACK_SLICE_BYTES = 8 << 20

_pack_lock = threading.Lock()

# storage(q shape, s shape) -> zero-filled q uint8 and s uint16 of those shapes, for a packed copy to be built in
Storage = Callable[[tuple[int, ...], tuple[int, ...]], tuple[np.ndarray, np.ndarray]]


def new_storage(q_shape: tuple[int, ...], s_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A packed copy's own arrays."""
    return np.zeros(q_shape, dtype=np.uint8), np.zeros(s_shape, dtype=np.uint16)


@dataclass(frozen=True)
class PackedWeight:
    """W regrouped for the decode kernels: q uint8 (G, nb, ROWS/L, QB/W, L, W), s uint16 (G, nb, NS, ROWS)."""

    code: int  # ggml type id
    q: np.ndarray
    s: np.ndarray
    block_bytes: int  # of the file's blocks
    copies: np.ndarray  # (k, 3) the layout's byte copies, for unpacking
    halves: np.ndarray  # (NS,) raw offsets of the 16-bit fields (half-float scales; Q5_0's qh)

    @classmethod
    def pack(
        cls, code: int, rows: int, cols: int, raw: np.ndarray, release: bool = False, storage: Storage = new_storage
    ) -> PackedWeight:
        """raw: uint8 (rows, row_bytes) in the file's block layout.

        With `release`, the file pages under raw are given back as each slice of rows is packed, so that a big
        matrix never has both copies resident. `storage` gives the arrays to pack into.
        """
        _, copies, halves = packed.layout_tables(code)
        block_bytes = FORMATS[T(code)].block_bytes
        n_groups = -(-rows // packed.ROWS)
        q, s = storage(*cls.shapes(code, rows, cols))
        raw = np.ascontiguousarray(raw)
        step = max(1, _PACK_SLICE_BYTES // (raw.shape[1] * packed.ROWS))  # groups per slice
        for g0 in range(0, n_groups, step):
            g1 = min(n_groups, g0 + step)
            part = raw[g0 * packed.ROWS : g1 * packed.ROWS]
            packed.pack(part, tag(code), block_bytes, copies, halves, q[g0:g1], s[g0:g1])
            if release:
                pages.release(part)
        return cls(code, q, s, block_bytes, copies, halves)

    @staticmethod
    def shapes(code: int, rows: int, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of q and s for a W (rows, cols) of format `code`, in this CPU's kernels' layout."""
        qb = packed.LAYOUT[code][0]
        fmt = FORMATS[T(code)]
        assert fmt.packing is not None  # every type in PACKED_TYPES has one
        n_groups, nb = -(-rows // packed.ROWS), cols // fmt.block
        lanes, width = packed.layout(code)
        return (n_groups, nb, packed.ROWS // lanes, qb // width, lanes, width), (
            n_groups, nb, fmt.packing.s_fields, packed.ROWS)  # fmt: skip

    @property
    def fmt(self) -> np.ndarray:
        """The format's tag, as the compiled kernels take it (formats.dispatch)."""
        return tag(self.code)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes

    def dequantize_rows(self, r0: int, out: np.ndarray) -> None:
        """W[r0 : r0 + len(out)] -> out float32."""
        packed.dequantize_rows(self.q, self.s, self.fmt, self.block_bytes, self.copies, self.halves, F16_TABLE, r0, out)


@dataclass(frozen=True)
class WeightMatrix:
    """A weight W (rows, cols) kept in its file encoding.

    `data` is uint8 (rows, row_bytes) for block formats, float32 (rows, cols) for F32 and
    uint16 (rows, cols) for F16/BF16 bit patterns. Types in PACKED_TYPES are repacked by `prepare()` (which
    the first product calls); from then on `data` is no longer read and its file pages are released.
    """

    name: str
    ggml_type: T
    rows: int  # output features
    cols: int  # input features
    data: np.ndarray
    storage: Storage = field(default=new_storage, repr=False, compare=False)  # where prepare() packs W
    _packed: list[PackedWeight] = field(default_factory=list, init=False, repr=False, compare=False)

    @classmethod
    def from_raw(cls, name: str, ggml_type: T, rows: int, cols: int, raw: np.ndarray) -> WeightMatrix:
        """Wrap the tensor bytes as the file stores them (any dtype view of the same buffer)."""
        data: np.ndarray
        if ggml_type == f32.TYPE:
            data = raw.view(np.float32).reshape(rows, cols)
        elif ggml_type in HALF_TYPES:
            data = raw.view(np.uint16).reshape(rows, cols)
        else:
            data = raw.view(np.uint8).reshape(rows, -1)
        return cls(name, ggml_type, rows, cols, data)

    @property
    def packed(self) -> PackedWeight | None:
        """The decode layout, once `prepare()` has built it."""
        return self._packed[0] if self._packed else None

    @property
    def nbytes(self) -> int:
        """The bytes a product reads: the packed copy's once built, else the stored data's."""
        p = self.packed
        return p.nbytes if p is not None else self.data.nbytes

    def packed_only(self) -> WeightMatrix:
        """W packed now, without its stored bytes: for a weight made in memory (engine/requantize.py), whose
        bytes would otherwise stay resident beside the packed copy. Its `data` is a read-only stand-in of the
        same shape (zero strides, reads as zeros): products, dequantizers and the float32 path all read the packed
        copy, and only token embeddings and GPU uploads read `data`, which such a weight never serves."""
        p = self.prepare().packed
        if p is None:
            raise ValueError(f"{self.name}: type {self.ggml_type.name} has no packed layout")
        stand_in = np.broadcast_to(np.zeros(1, dtype=self.data.dtype), self.data.shape)
        w = WeightMatrix(self.name, self.ggml_type, self.rows, self.cols, stand_in)
        w._packed.append(p)
        return w

    def release_file_pages(self) -> None:
        """Once W is packed, drop the file pages under its stored bytes again. Packing released them, but
        reading the next matrix in the file maps the 64 KB around each page it faults in (the kernel's
        fault-around), this matrix's tail among them: SmolLM2's 210 matrices kept 6 MB of the file so."""
        if self.packed is not None:
            pages.release(self.data)

    def prepare(self) -> WeightMatrix:
        """Repack W for the decode kernels now, if its type has them; idempotent and thread-safe."""
        if not self._packed and self.ggml_type in PACKED_TYPES:
            with _pack_lock:
                if not self._packed:
                    code = BLOCK_CODES[self.ggml_type]
                    packed_w = PackedWeight.pack(code, self.rows, self.cols, self.data, True, self.storage)
                    self._packed.append(packed_w)
        return self


def prepare_stacked(ws: Sequence[WeightMatrix], raw: np.ndarray, q_all: np.ndarray, s_all: np.ndarray,
                    which: np.ndarray) -> None:  # fmt: skip
    """`prepare()` of several matrices of one shape and packed type that lie stacked in raw (n·rows, row_bytes),
    ws[i] at rows which[i]·rows, packed into q_all[which[i]] and s_all[which[i]] (n, ...), zero-filled where
    not yet packed, in one parallel launch (a mixture-of-experts pass's newly chosen experts: one launch a
    matrix left much of their packing to Python and to launches). Each W's file pages are released after."""
    pending = [(w, e) for w, e in zip(ws, np.asarray(which).tolist(), strict=True) if w.packed is None]
    if not pending:
        return
    code = BLOCK_CODES[pending[0][0].ggml_type]
    _, copies, halves = packed.layout_tables(code)
    block_bytes = FORMATS[T(code)].block_bytes
    with _pack_lock:
        pending = [(w, e) for w, e in pending if not w._packed]  # another thread may have packed some
        if not pending:
            return
        rows = np.array([e for _, e in pending], dtype=np.int64)
        packed.pack_many(raw, tag(code), block_bytes, copies, halves, q_all, s_all, rows)
        for w, e in pending:
            w._packed.append(PackedWeight(code, q_all[e], s_all[e], block_bytes, copies, halves))
            pages.release(w.data)


def _float_rows(w: WeightMatrix, r0: int, r1: int) -> np.ndarray:
    """W[r0:r1] as float32 for the float formats."""
    return FLOAT_VALUES[w.ggml_type](w.data[r0:r1])


def dequantize_rows(w: WeightMatrix, r0: int, out: np.ndarray) -> np.ndarray:
    """W[r0 : r0 + len(out)] as float32 into out; returns out (or, for F32, a view of W)."""
    p = w.packed
    if p is not None:
        p.dequantize_rows(r0, out)
        return out
    code = BLOCK_CODES.get(w.ggml_type)
    if code is not None:
        cpu.dequantize_rows(w.data, tag(code), F16_TABLE, r0, out)
        return out
    return _float_rows(w, r0, r0 + out.shape[0])


def dequantize(w: WeightMatrix) -> np.ndarray:
    """The whole of W as float32 (rows, cols). For tests and small tensors only."""
    out = np.empty((w.rows, w.cols), dtype=np.float32)
    got = dequantize_rows(w, 0, out)
    return got if got is out else np.array(got, dtype=np.float32)
