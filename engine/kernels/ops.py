"""The kernel layer's operations (see the package docstring, engine/kernels/__init__.py): products over a
`WeightMatrix`, norms, RoPE, the attention wrapper and BLAS discovery.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import get_num_threads

from .. import cache_types
from ..formats import FORMATS, QUANTIZED, bf16, f16, f32
from ..formats.dispatch import tag
from ..formats.fields import F16_TABLE
from . import attention, cpu, decode, floats, packed, pages
from .scratch import Scratch

BLOCK_CODES = {t: f.code for t, f in QUANTIZED.items()}  # each block format's ggml type -> its dispatch code
FLOAT_TYPES = (f32.TYPE, f16.TYPE, bf16.TYPE)
_HALF_TYPES = (f16.TYPE, bf16.TYPE)  # 16-bit floats: products in floats.py
_FLOAT_VALUES = {m.TYPE: m.values for m in (f32, f16, bf16)}  # stored data -> float32
SUPPORTED_TYPES = frozenset(BLOCK_CODES) | frozenset(FLOAT_TYPES)
# Types with a repacked decode kernel; the others keep the per-row kernels of cpu.py.
PACKED_TYPES = frozenset(t for t, code in BLOCK_CODES.items() if code in packed.PACKED_CODES)

# Prefill dequantizes this many float32 values of W at a time before handing the tile to BLAS.
_TILE_VALUES = 1 << 21  # 8 MB
# Decode products over fewer bytes than this run on the calling thread: waking the other threads (6-45 µs
# with OpenMP on an idle machine, milliseconds on a busy one) costs more than the second core saves.
PARALLEL_MIN_BYTES = 256 << 10
# Weights are packed this many file bytes at a time, each slice's file pages released before the next.
_PACK_SLICE_BYTES = 8 << 20

_pack_lock = threading.Lock()
_float_products = False  # see float_products()


@contextmanager
def float_products() -> Iterator[None]:
    """Within the block, every product takes the float32 path (as `exact=True`), in all threads.

    int8 activations make the logits depend discontinuously on x: the same tokens evaluated in different
    chunks differ by float rounding upstream, which flips a few roundings to int8 and moves SmolLM2's logits by
    up to ~2% of their spread (0.02% with float products), as llama.cpp's do. Tests of bookkeeping such as the
    KV cache can compare chunkings tightly in here. Slow: every product dequantizes its whole weight.
    """
    global _float_products
    before, _float_products = _float_products, True
    try:
        yield
    finally:
        _float_products = before


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
    def pack(cls, code: int, rows: int, cols: int, raw: np.ndarray, release: bool = False) -> PackedWeight:
        """raw: uint8 (rows, row_bytes) in the file's block layout.

        With `release`, the file pages under raw are given back as each slice of rows is packed, so that a big
        matrix never has both copies resident.
        """
        qb, copies, halves = packed.layout_tables(code)
        fmt = FORMATS[T(code)]
        block, block_bytes = fmt.block, fmt.block_bytes
        n_groups = -(-rows // packed.ROWS)
        lanes, width = packed.layout(code)  # this CPU's kernels' layout
        q = np.zeros((n_groups, cols // block, packed.ROWS // lanes, qb // width, lanes, width), dtype=np.uint8)
        s = np.zeros((n_groups, cols // block, fmt.packing.s_fields, packed.ROWS), dtype=np.uint16)
        raw = np.ascontiguousarray(raw)
        step = max(1, _PACK_SLICE_BYTES // (raw.shape[1] * packed.ROWS))  # groups per slice
        for g0 in range(0, n_groups, step):
            g1 = min(n_groups, g0 + step)
            part = raw[g0 * packed.ROWS : g1 * packed.ROWS]
            packed.pack(part, tag(code), block_bytes, copies, halves, q[g0:g1], s[g0:g1])
            if release:
                pages.release(part)
        return cls(code, q, s, block_bytes, copies, halves)

    @property
    def fmt(self) -> np.ndarray:
        """The format's tag, as the compiled kernels take it (formats.dispatch)."""
        return tag(self.code)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes

    def decode_rows(self, r0: int, out: np.ndarray) -> None:
        """W[r0 : r0 + len(out)] -> out float32."""
        packed.dequantize_rows(
            self.q, self.s, self.fmt, self.block_bytes, self.copies, self.halves, F16_TABLE, r0, out
        )


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
    _packed: list[PackedWeight] = field(default_factory=list, init=False, repr=False, compare=False)

    @classmethod
    def from_raw(cls, name: str, ggml_type: T, rows: int, cols: int, raw: np.ndarray) -> WeightMatrix:
        """Wrap the tensor bytes as the file stores them (any dtype view of the same buffer)."""
        if ggml_type == f32.TYPE:
            data = raw.view(np.float32).reshape(rows, cols)
        elif ggml_type in _HALF_TYPES:
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
        same shape (zero strides, reads as zeros): products, decoders and the float32 path all read the packed
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
                    self._packed.append(PackedWeight.pack(code, self.rows, self.cols, self.data, release=True))
        return self


def _float_rows(w: WeightMatrix, r0: int, r1: int) -> np.ndarray:
    """W[r0:r1] as float32 for the float formats."""
    return _FLOAT_VALUES[w.ggml_type](w.data[r0:r1])


def _decode_rows(w: WeightMatrix, r0: int, out: np.ndarray) -> np.ndarray:
    """W[r0 : r0 + len(out)] as float32 into out; returns out (or, for F32, a view of W)."""
    p = w.packed
    if p is not None:
        p.decode_rows(r0, out)
        return out
    code = BLOCK_CODES.get(w.ggml_type)
    if code is not None:
        cpu.dequantize_rows(w.data, tag(code), F16_TABLE, r0, out)
        return out
    return _float_rows(w, r0, r0 + out.shape[0])


def _tiled_matvec(w: WeightMatrix, x: np.ndarray, out: np.ndarray) -> None:
    """out = W @ x in float32, W decoded a tile at a time."""
    step = max(1, min(w.rows, _TILE_VALUES // w.cols))
    tile = np.empty((step, w.cols), dtype=np.float32)
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        np.matmul(_decode_rows(w, r0, tile[: r1 - r0]), x, out=out[r0:r1])


def matvec(w: WeightMatrix, x: np.ndarray, out: np.ndarray | None = None, *, exact: bool | None = None) -> np.ndarray:
    """W (rows, cols) @ x (cols,) -> (rows,) float32.

    Repacked types compute W @ x̂, x̂ = x quantized to int8 per 32 values (llama.cpp's q8_0); `exact=True`
    uses x itself, in float32 (slow: for reference checks). None: as `float_products()` says.
    """
    if exact is None:
        exact = _float_products
    if out is None:
        out = np.empty(w.rows, dtype=np.float32)
    elif out.dtype != np.float32 or not out.flags.c_contiguous:  # the kernels are compiled for these only
        out[...] = matvec(w, x, exact=exact)
        return out
    x = np.ascontiguousarray(x, dtype=np.float32)
    p = w._packed[0] if w._packed else w.prepare().packed
    if p is not None:
        if exact:
            _tiled_matvec(w, x, out)
        elif p.nbytes < PARALLEL_MIN_BYTES:
            packed.matvec_serial(p.q, p.s, p.fmt, x, out)
        else:
            packed.matvec(p.q, p.s, p.fmt, x, out)
        return out
    code = BLOCK_CODES.get(w.ggml_type)
    if code is not None:
        cpu.matvec(w.data, tag(code), F16_TABLE, x, out)
    elif w.ggml_type == f32.TYPE:
        np.matmul(w.data, x, out=out)
    elif w.data.nbytes < PARALLEL_MIN_BYTES:
        floats.matvec_serial(w.data, w.ggml_type == bf16.TYPE, x, out)
    else:
        floats.matvec(w.data, w.ggml_type == bf16.TYPE, x, out)
    return out


def matvec_many(ws: Sequence[WeightMatrix], x: np.ndarray) -> list[np.ndarray]:
    """[W @ x for W in ws] (each (rows,) float32), the packed ones sharing one parallel launch.

    For projections of the same input: q, k, v or gate, up. Same numerics as `matvec`.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if _float_products:
        return [matvec(w, x) for w in ws]
    outs = [np.empty(w.rows, dtype=np.float32) for w in ws]
    idx = []
    for i, w in enumerate(ws):
        if w.cols != x.shape[0]:
            raise ValueError(f"{w.name}: {w.cols} columns, x has {x.shape[0]}")
        if w.prepare().packed is None:
            matvec(w, x, outs[i])
        else:
            idx.append(i)
    ps = [ws[i].packed for i in idx]
    if len(ps) > 1 and sum(p.nbytes for p in ps) >= PARALLEL_MIN_BYTES:
        qs, ss, fmts = tuple(p.q for p in ps), tuple(p.s for p in ps), tuple(p.fmt for p in ps)
        packed.matvec_many(qs, ss, fmts, x, tuple(outs[i] for i in idx))
    else:
        for i in idx:
            matvec(ws[i], x, outs[i])
    return outs


def matmul(
    w: WeightMatrix, xs: np.ndarray, *, exact: bool | None = None, out: np.ndarray | None = None,
    scratch: Scratch | None = None, same_input: bool = False, rowwise: bool = False,
) -> np.ndarray:  # fmt: skip
    """xs (t, cols) @ W.T -> (t, rows) float32, into out where given (C-contiguous).

    Packed types give each row `matvec`'s result bit for bit at any t. With rowwise, so do the float types
    (F16, BF16 by floats.matmul_rows, F32 by one `matvec` a row), where BLAS's sums would otherwise depend on t.

    Repacked types run the decode kernels on every row of xs, each quantized to int8 per 32 values as in
    `matvec` (into scratch's buffers where given); the others (and `exact=True`) dequantize W a tile at a
    time and multiply with BLAS. same_input: xs is unchanged since the last product into this scratch, and
    where that product quantized this very array, its quantized rows are used again (a layer's q, k and v,
    its gate and up: SmolLM2's prompt rows cost ~45 µs to quantize, 210 times a 256-token pass).
    """
    if exact is None:
        exact = _float_products
    t = xs.shape[0]
    out = np.empty((t, w.rows), dtype=np.float32) if out is None else out
    if t == 1 and not exact:
        matvec(w, xs[0], out[0])
        return out
    if rowwise and not exact and w.ggml_type in FLOAT_TYPES:
        xs = np.ascontiguousarray(xs, dtype=np.float32)
        if w.ggml_type == f32.TYPE:  # matvec's BLAS product, a row at a time (F32 matrices: small test models)
            for i in range(t):
                np.matmul(w.data, xs[i], out=out[i])
        else:
            floats.matmul_rows(w.data, w.ggml_type == bf16.TYPE, xs, out)
        return out
    if w.ggml_type == f32.TYPE:
        return np.matmul(xs, w.data.T, out=out)
    p = w.prepare().packed
    if p is not None and not exact:
        xs = np.ascontiguousarray(xs, dtype=np.float32)
        reuse = same_input and scratch is not None and scratch.quantized_input is xs
        buffers = packed.row_buffers(t, w.cols, scratch and scratch.take, bool(packed.PAIRED[p.code]))
        packed.matmul(p.q, p.s, p.fmt, xs, out, *buffers, reuse)
        if scratch is not None:
            scratch.quantized_input = xs  # held, so that no other array can take its identity
        return out
    if w.ggml_type in _HALF_TYPES and blas_sgemm_address():
        xs = np.ascontiguousarray(xs, dtype=np.float32)
        floats.matmul(blas_sgemm_address(), w.data, w.ggml_type == bf16.TYPE, xs, get_num_threads(), out)
        return out
    step = max(1, min(w.rows, _TILE_VALUES // w.cols))
    tile = np.empty((step, w.cols), dtype=np.float32)
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        np.matmul(xs, _decode_rows(w, r0, tile[: r1 - r0]).T, out=out[:, r0:r1])
    return out


def embedding_rows(w: WeightMatrix, ids: np.ndarray, file_rows: pages.FileRows | None = None) -> np.ndarray:
    """Rows `ids` of W, decoded: (len(ids), cols) float32. Only those rows are ever expanded.

    Decoded from the file's bytes by the format's array-module decoder, in NumPy: 20-30 µs a token (SmolLM2,
    Qwen2.5 1.5B), where the compiled row decoders of every format cost a first start ~17 s of compiling.
    With `file_rows` (a reader of w.data's file) the bytes are read from the file, so that looking rows up
    never makes the mapped table resident (see pages.py); a failed read falls back to the mapping.
    """
    ids = np.asarray(ids, dtype=np.int64)
    rows = None
    if file_rows is not None:
        with suppress(OSError):
            rows = file_rows.take(ids)
    if rows is None:
        rows = w.data[ids]  # (t, row_bytes) for block formats, a copy
    if w.ggml_type in FLOAT_TYPES:
        return np.ascontiguousarray(_FLOAT_VALUES[w.ggml_type](rows), dtype=np.float32)  # rows is a copy already
    fmt = FORMATS[w.ggml_type]
    blocks = rows.reshape(-1, fmt.block_bytes)  # (t·nb, block_bytes)
    return fmt.decode(np, blocks).reshape(len(rows), w.cols)


def dequantize(w: WeightMatrix) -> np.ndarray:
    """The whole of W as float32 (rows, cols). For tests and small tensors only."""
    out = np.empty((w.rows, w.cols), dtype=np.float32)
    got = _decode_rows(w, 0, out)
    return got if got is out else np.array(got, dtype=np.float32)


def rms_norm_rows(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm of every row of x (t, d) float32 -> (t, d), rows in parallel, each as the decode layer's; into
    out where given (x itself may be out)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x) if out is None else out
    decode.rms_norm_rows(x, w, eps, out)
    return out


def layer_norm_rows(
    x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, out: np.ndarray | None = None
) -> np.ndarray:
    """LayerNorm of every row of x (t, d) float32 -> (t, d), each as the decode layer's; into out where given."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x) if out is None else out
    decode.layer_norm_rows(x, w, b, eps, out)
    return out


def gelu_rows(x: np.ndarray) -> np.ndarray:
    """GELU (tanh form) of x (t, n) float32 in place, each value as the decode layer's; returns x."""
    decode.gelu_rows(x)
    return x


def rope_into_cache(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int,
    cos: np.ndarray, sin: np.ndarray, shape: tuple[int, int, int, int, bool],
) -> None:  # fmt: skip
    """Rotate a prompt's q (t, n_head·hd) and k (t, n_kv·hd) in place, round q to float16 values, and write k
    and v (t, n_kv·hd) into the cache kc, vc (n_kv, rows, width) at positions start.. (row p % rows): the
    decode layer's arithmetic, row by row in parallel. cos, sin (t, rope_dim/2); shape (n_head, n_kv, hd,
    rope_dim, neox); rope_dim 0 rotates nothing.
    """
    n_head, n_kv, hd, rope_dim, neox = shape
    dims = (n_head, n_kv, hd, rope_dim, int(neox))
    decode.rope_into_cache(q, k, v, start, cos, sin, dims, cache_bits(kc), cache_bits(vc))


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up for gate, up (t, d_ff) float32 -> (t, d_ff) float32, compiled and parallel; into out
    where given (gate itself may be out: the kernel runs in place, so any other out gets a copy of gate first)."""
    up = np.ascontiguousarray(up, dtype=np.float32)
    if out is None:
        out = np.array(gate, dtype=np.float32, order="C")
    elif out is not gate:
        np.copyto(out, gate)
    attention.swiglu(out, up, out)
    return out


def geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """gelu(gate) * up as ggml rounds it (attention.gelu_half), gate, up (t, d_ff) float32 -> (t, d_ff); into
    out where given (gate itself may be out)."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    up = np.ascontiguousarray(up, dtype=np.float32)
    out = np.empty_like(gate) if out is None else out
    attention.geglu(gate, up, out, attention.gelu_table())
    return out


# Passes of up to this many tokens (a draft's check) attend each query as the one-token kernel does, so their
# logits are a plain decode's bit for bit and greedy output never leaves it at a near-tie; longer ones use BLAS.
SHORT_PASS = packed.SHORT_MAX


def causal_attention(
    q: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int,
    scale: float | None = None, window: int = 0, softcap: float = 0.0, out: np.ndarray | None = None,
    rowwise: bool = False, scratch: Scratch | None = None,
) -> np.ndarray:  # fmt: skip
    """Queries at positions start.. over the cached keys each one sees: up to its own position, and within
    the last `window` positions when window > 0.

    q (t, n_head, hd); kc, vc (n_kv, rows, width) of a cache type (engine/cache_types.py: float16 (.., hd), or
    uint8 q8_0 blocks), K and V each their own, position p in row p % rows -> (t, n_head·hd) float32,
    into out where given (except without BLAS: use the result). Scores are scale · q·k (default 1/√hd),
    soft-capped as cap·tanh(s/cap) when softcap > 0. Query head h reads kv head h // (n_head / n_kv). Blocks
    of queries run in parallel, each with single-threaded BLAS products (attention.attend_causal, its buffers
    from scratch where given); without a usable BLAS sgemm, the same arithmetic runs here in NumPy. Passes of
    up to SHORT_PASS queries, and any with rowwise, run each query through the one-token kernel instead
    (attention.attend_rows).
    """
    t, n_head, hd = q.shape
    scale = float(1.0 / np.sqrt(hd)) if scale is None else float(scale)
    q = np.ascontiguousarray(q, dtype=np.float32)
    kc16, vc16 = cache_bits(kc), cache_bits(vc)
    if t == 1:  # decode: the one-query kernel (as decode.layer's), no BLAS call for a single row
        out = np.empty((1, n_head * hd), dtype=np.float32) if out is None else out
        threads = get_num_threads()
        attention.attend_one(q.reshape(-1), kc16, vc16, start, n_head, scale, window, softcap, threads, out[0])
        return out
    if t <= SHORT_PASS or rowwise:
        out = np.empty((t, n_head * hd), dtype=np.float32) if out is None else out
        attention.attend_rows(q.reshape(t, -1), kc16, vc16, start, n_head, scale, window, softcap, out)
        return out
    fn = blas_sgemm_address()
    if fn:
        out = np.empty((t, n_head * hd), dtype=np.float32) if out is None else out
        threads = get_num_threads()
        size = attention.causal_work_size(t, n_head, kc.shape[0], hd, start, window, threads)
        work = scratch.take("attention blocks", (size,)) if scratch is not None else np.empty(size, np.float32)
        attention.attend_causal(fn, q, kc16, vc16, start, scale, window, softcap, threads, work, out)
        return out
    n_kv = kc.shape[0]
    group = n_head // n_kv
    lo = max(0, start - window + 1) if window > 0 else 0  # the oldest key any of these queries sees
    rows = np.arange(lo, start + t) % kc.shape[1]  # (n_keys,) cache rows in position order
    qg = np.ascontiguousarray(q.transpose(1, 0, 2)).reshape(n_kv, group * t, hd)  # rows (g, i) per kv head
    out = np.empty((n_kv, group * t, hd), dtype=np.float32)  # (n_kv, group·t, hd)
    for kv in range(n_kv):
        scores = np.matmul(qg[kv], cache_types.to_floats(np, kc[kv, rows]).T)  # (group·t, n_keys)
        attention.causal_softmax(scores, 0, t, start, lo, scale, window, softcap)
        np.matmul(scores, cache_types.to_floats(np, vc[kv, rows]), out=out[kv])
    return out.reshape(n_head, t, hd).transpose(1, 0, 2).reshape(t, n_head * hd)


def cache_bits(cache: np.ndarray) -> np.ndarray:
    """A cache as the kernels take it: float16 as its bit patterns (uint16), q8_0 blocks (uint8) as they are."""
    return cache if cache.dtype == np.uint8 else cache.view(np.uint16)


_SGEMM_SYMBOLS = ("scipy_cblas_sgemm64_", "cblas_sgemm64_")  # 64-bit-integer (ILP64) cblas_sgemm, as NumPy ships
_sgemm_address: list[int] = []


def blas_sgemm_address() -> int:
    """Address of the cblas_sgemm in NumPy's own BLAS (found through threadpoolctl), or 0 when there is none
    with 64-bit integers. Cached."""
    if not _sgemm_address:
        _sgemm_address.append(_find_sgemm())
    return _sgemm_address[0]


def _find_sgemm() -> int:
    import ctypes

    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info.get("user_api") != "blas":
            continue
        try:
            lib = ctypes.CDLL(info["filepath"])
        except OSError:
            continue
        for name in _SGEMM_SYMBOLS:
            fn = getattr(lib, name, None)
            if fn is not None:
                return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)
    return 0


def float_products_active() -> bool:
    """Whether `float_products()` is in force."""
    return _float_products
