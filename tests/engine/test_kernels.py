"""Every kernel against gguf.quants.dequantize, on synthetic blocks of every type and on the real models."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine.gguf_file import open_gguf
from engine.kernels import SUPPORTED_TYPES, WeightMatrix, dequantize, embedding_rows, matmul, matvec

# Byte offsets of the half-float scale fields in each block, so synthetic blocks get finite scales.
HALF_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
BLOCK_TYPES = list(HALF_FIELDS)


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in qtype's block layout, with sane scales: uint8 (rows, row_bytes)."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        raw[:, off : off + 2] = rng.uniform(-0.1, 0.1, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def oracle(qtype: T, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)


def check_products(w: WeightMatrix, ref: np.ndarray, rng: np.random.Generator) -> None:
    x = rng.standard_normal(w.cols).astype(np.float32)
    xs = rng.standard_normal((5, w.cols)).astype(np.float32)
    want_v = ref.astype(np.float64) @ x
    want_m = xs.astype(np.float64) @ ref.astype(np.float64).T
    scale_v = np.abs(want_v).max() + 1e-6
    scale_m = np.abs(want_m).max() + 1e-6
    assert np.abs(matvec(w, x) - want_v).max() / scale_v < 1e-5, w.name
    assert np.abs(matmul(w, xs) - want_m).max() / scale_m < 1e-5, w.name
    ids = np.array([0, w.rows - 1, w.rows // 2])
    np.testing.assert_array_equal(embedding_rows(w, ids), ref[ids])


def test_every_supported_type_is_covered() -> None:
    assert SUPPORTED_TYPES == set(BLOCK_TYPES) | {T.F32, T.F16, T.BF16}


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_formats_match_gguf_dequantize(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    rows, cols = 48, 512
    raw = random_blocks(qtype, rows, cols, rng)
    w = WeightMatrix.from_raw("synthetic", qtype, rows, cols, raw)
    ref = oracle(qtype, raw, rows, cols)
    np.testing.assert_array_equal(dequantize(w), ref)
    check_products(w, ref, rng)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_formats(qtype: T) -> None:
    rng = np.random.default_rng(7)
    a = rng.standard_normal((40, 96)).astype(np.float32)
    if qtype == T.F32:
        raw = a
    elif qtype == T.F16:
        raw = a.astype(np.float16)
    else:
        raw = (a.view(np.uint32) >> 16).astype(np.uint16)
    w = WeightMatrix.from_raw("synthetic", qtype, 40, 96, raw.view(np.uint8))
    ref = oracle(qtype, raw.view(np.uint8).reshape(40, -1), 40, 96)
    np.testing.assert_array_equal(dequantize(w), ref)
    check_products(w, ref, rng)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_requantized_real_weights(qtype: T, smollm2_path) -> None:
    """A real SmolLM2 matrix, decoded and re-encoded by gguf's quantizer into each 32-block type."""
    f = open_gguf(smollm2_path)
    t = f.tensors["blk.3.ffn_up.weight"]
    cols, rows = t.shape
    real = gguf.quants.dequantize(t.data, t.ggml_type).reshape(rows, cols)
    raw = gguf.quants.quantize(real, qtype)
    w = WeightMatrix.from_raw("requantized", qtype, rows, cols, raw)
    ref = oracle(qtype, raw, rows, cols)
    np.testing.assert_array_equal(dequantize(w), ref)
    check_products(w, ref, np.random.default_rng(1))


@pytest.mark.parametrize("model", ["smollm2", "qwen"])
def test_real_tensors_of_every_type_in_the_models(model: str, smollm2_path, qwen_path) -> None:
    f = open_gguf(smollm2_path if model == "smollm2" else qwen_path)
    seen = set()
    rng = np.random.default_rng(3)
    for t in f.tensors.values():
        if len(t.shape) != 2 or t.ggml_type in seen:
            continue
        seen.add(t.ggml_type)
        cols, rows = t.shape
        rows = min(rows, 1024)  # a slice of the big embedding matrices is enough
        data = t.data[:rows]
        w = WeightMatrix.from_raw(t.name, t.ggml_type, rows, cols, data)
        ref = oracle(t.ggml_type, data, rows, cols)
        np.testing.assert_array_equal(dequantize(w), ref)
        check_products(w, ref, rng)
    expected = {"smollm2": {T.Q4_1, T.Q8_0}, "qwen": {T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K}}[model]
    assert expected <= seen
