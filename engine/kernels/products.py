"""The products over a `WeightMatrix`: W @ x for one token (`matvec`, `matvec_many`) and for a prompt's rows
(`matmul`), each sent to the kernel of W's encoding (packed.py, cpu.py, floats.py, or BLAS: its sgemm found
here), and the switch to float32 products (`float_products`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
from numba import get_num_threads

from ..formats import bf16, f32
from ..formats.dispatch import tag
from ..formats.fields import F16_TABLE
from . import cpu, floats, packed
from .scratch import Scratch
from .weight_matrix import BLOCK_CODES, FLOAT_TYPES, HALF_TYPES, PackedWeight, WeightMatrix, dequantize_rows

# Prefill dequantizes this many float32 values of W at a time before handing the tile to BLAS.
_TILE_VALUES = 1 << 21  # 8 MB
# Decode products over fewer bytes than this run on the calling thread: waking the other threads (6-45 µs
# with OpenMP on an idle machine, milliseconds on a busy one) costs more than the second core saves.
PARALLEL_MIN_BYTES = 256 << 10

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


def _tiled_matvec(w: WeightMatrix, x: np.ndarray, out: np.ndarray) -> None:
    """out = W @ x in float32, W dequantized a tile at a time."""
    step = max(1, min(w.rows, _TILE_VALUES // w.cols))
    tile = np.empty((step, w.cols), dtype=np.float32)
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        np.matmul(dequantize_rows(w, r0, tile[: r1 - r0]), x, out=out[r0:r1])


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
    idx: list[int] = []  # the packed ones: their index in ws, and their packed copy
    ps: list[PackedWeight] = []
    for i, w in enumerate(ws):
        if w.cols != x.shape[0]:
            raise ValueError(f"{w.name}: {w.cols} columns, x has {x.shape[0]}")
        p = w.prepare().packed
        if p is None:
            matvec(w, x, outs[i])
        else:
            idx.append(i)
            ps.append(p)
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
    if w.ggml_type in HALF_TYPES and blas_sgemm_address():
        xs = np.ascontiguousarray(xs, dtype=np.float32)
        floats.matmul(blas_sgemm_address(), w.data, w.ggml_type == bf16.TYPE, xs, get_num_threads(), out)
        return out
    step = max(1, min(w.rows, _TILE_VALUES // w.cols))
    tile = np.empty((step, w.cols), dtype=np.float32)
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        np.matmul(xs, dequantize_rows(w, r0, tile[: r1 - r0]).T, out=out[:, r0:r1])
    return out


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
