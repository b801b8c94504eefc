"""The row operations of a prompt pass, each row computed as the one-token layer computes it (decode.py,
attention.py): token embeddings, norms, GELU, RoPE into the cache, SwiGLU and GeGLU.
"""

from __future__ import annotations

from contextlib import suppress

import numpy as np

from .. import cache_types
from ..formats import FORMATS
from . import attention, decode, pages
from .weight_matrix import FLOAT_TYPES, FLOAT_VALUES, WeightMatrix


def embedding_rows(w: WeightMatrix, ids: np.ndarray, file_rows: pages.FileRows | None = None) -> np.ndarray:
    """Rows `ids` of W, dequantized: (len(ids), cols) float32. Only those rows are ever expanded.

    Dequantized from the file's bytes by the format's array-module dequantizer, in NumPy: 20-30 µs a token (SmolLM2,
    Qwen2.5 1.5B), where the compiled row dequantizers of every format cost a first start ~17 s of compiling.
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
        return np.ascontiguousarray(FLOAT_VALUES[w.ggml_type](rows), dtype=np.float32)  # rows is a copy already
    fmt = FORMATS[w.ggml_type]
    blocks = rows.reshape(-1, fmt.block_bytes)  # (t·nb, block_bytes)
    return fmt.dequantize(np, blocks).reshape(len(rows), w.cols)


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
    decode.rope_into_cache(q, k, v, start, cos, sin, dims, cache_types.cache_bits(kc), cache_types.cache_bits(vc))


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
