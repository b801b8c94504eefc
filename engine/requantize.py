"""A model's weight matrices re-encoded at load in fewer bits, for a draft model.

A draft model only guesses: the target checks every guess, so the reply is the same whatever the draft's
precision. Decode reads every weight once a token, so a draft's cost per guess is its bytes: Qwen2.5-Coder-0.5B
Q4_K_M reads 392 MB a token (a Q8_0 output head of 145 MB, Q5_0 and Q6_K layers), 278 MB once every matrix
stored in more than Q4_0's 4.5 bits per weight is Q4_0. Matrices at or under that stay as they are, so Q4_K
keeps its finer scales. The values are dequantized to float32 and quantized by the format's quantizer (Q4_0's writes
the bytes of ggml's `quantize_row_q4_0_ref`), a slice of rows at a time, then packed for this CPU's kernels; the
re-encoded bytes are not kept, since packed weights never read them again.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from .errors import SettingsError
from .formats import FORMATS
from .kernels import PACKED_TYPES, WeightMatrix, embedding_rows
from .weights import LayerWeights, Weights

# The types a draft may be re-encoded to, by the name users give: those with a quantizer and packed kernels.
TYPES = {t.name.lower(): t for t, f in FORMATS.items() if f.quantize is not None and t in PACKED_TYPES}
_SLICE_VALUES = 1 << 21  # values dequantized and quantized at a time by one thread (8 MB of float32)


def bits_per_weight(t: T) -> float:
    block, block_bytes = gguf.GGML_QUANT_SIZES[t]
    return 8.0 * block_bytes / block


def parse_type(name: str) -> T | None:
    """A draft type as the settings name it: one of TYPES, or "file" (None: the file's own types)."""
    key = name.strip().lower()
    if key == "file":
        return None
    if key not in TYPES:
        raise SettingsError(f"draft type {name!r}: choose one of file, {', '.join(TYPES)}")
    return TYPES[key]


def requantize_matrix(w: WeightMatrix, to: T, pool: ThreadPoolExecutor | None = None) -> WeightMatrix:
    """W in type `to`, packed; W itself when its type has no more bits per weight than `to`'s, or its rows do
    not divide into `to`'s blocks. Slices of rows are dequantized (by the formats' NumPy dequantizers: nothing to
    compile) and quantized on `pool`'s threads, where given."""
    fmt = FORMATS[to]
    if to not in TYPES.values() or bits_per_weight(w.ggml_type) <= bits_per_weight(to) or w.cols % fmt.block:
        return w
    quantize = fmt.quantize
    assert quantize is not None  # every type of TYPES has a quantizer
    raw = np.empty((w.rows, w.cols // fmt.block * fmt.block_bytes), dtype=np.uint8)  # (rows, row bytes) in `to`
    step = max(1, _SLICE_VALUES // w.cols)

    def run(r0: int) -> None:
        r1 = min(w.rows, r0 + step)
        raw[r0:r1] = quantize(embedding_rows(w, np.arange(r0, r1)))  # (r1 - r0, cols) float32 in between

    starts = range(0, w.rows, step)
    list(pool.map(run, starts) if pool is not None else map(run, starts))
    return WeightMatrix.from_raw(w.name, to, w.rows, w.cols, raw).packed_only()


def requantize_weights(weights: Weights, to: T, threads: int | None = None) -> Weights:
    """Every matrix of the layers and the output head in `to` where that has fewer bits. The token embedding
    stays as the file has it: its rows are read one token at a time, not once a token."""
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:

        def one(m: WeightMatrix) -> WeightMatrix:
            return requantize_matrix(m, to, pool)

        def layer(lw: LayerWeights) -> LayerWeights:
            names = ("wo", "w_gate", "w_up", "w_down")
            mats: dict[str, Any] = {name: one(m) for name in names if (m := getattr(lw, name)) is not None}
            q, k, v = lw.wqkv
            return dataclasses.replace(lw, wqkv=(one(q), one(k), one(v)), **mats)

        return dataclasses.replace(
            weights, layers=tuple(layer(lw) for lw in weights.layers), output=one(weights.output)
        )

