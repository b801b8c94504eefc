"""Every kernel against gguf.quants.dequantize, on synthetic blocks of every type and on the real models.

Decode products of the repacked types (PACKED_TYPES) quantize x to int8 per 32 values, as llama.cpp does: they
are checked exactly against W @ x̂ (x̂ from the reference quantizer below), and against W @ x within the bound
that rounding x implies. `matvec(..., exact=True)` is the float path and keeps the float tolerance.
"""

from __future__ import annotations

import gguf
import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine.formats import q6_k
from engine.formats.fields import F16_TABLE
from engine.formats.spec import ordered_copies
from engine.gguf_file import open_gguf
from engine.kernels import (
    PACKED_TYPES,
    PARALLEL_MIN_BYTES,
    SUPPORTED_TYPES,
    WeightMatrix,
    dequantize,
    embedding_rows,
    float_products,
    floats,
    matmul,
    matvec,
    matvec_many,
    packed,
    pages,
)
from engine.kernels.scratch import Scratch

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
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
    T.MXFP4: [],
}
BLOCK_TYPES = list(HALF_FIELDS)
# Byte offsets of E8M0 scales (2**(e - 128)): exponents drawn from 118..123, so values stay within ±12 · 2**-5,
# where a random byte could reach 12 · 2**127 = inf.
E8M0_FIELDS = {T.MXFP4: [0]}


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in qtype's block layout, with sane scales: uint8 (rows, row_bytes)."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        raw[:, off : off + 2] = rng.uniform(-0.1, 0.1, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    for off in E8M0_FIELDS.get(qtype, []):
        raw[:, off] = rng.integers(118, 124, raw.shape[0])
    return raw.reshape(rows, -1)


def oracle(qtype: T, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's activation quantization (quantize_row_q8_0), in float32 like the kernels: x̂ (n,), dx (n/32,)."""
    blocks = x.reshape(-1, 32)
    dx = (np.abs(blocks).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.zeros_like(dx)
    np.divide(np.float32(1), dx, out=inv, where=dx > 0)
    xq = np.round(blocks * inv[:, None])
    return (xq.astype(np.float64) * dx[:, None]).reshape(-1), dx


def check_int8_matvec(w: WeightMatrix, ref: np.ndarray, x: np.ndarray, got: np.ndarray) -> None:
    """The int8 decode path: W @ x̂ to float32 rounding, and W @ x within the activation-rounding bound.

    |x - x̂| <= dx/2 elementwise (round to nearest), so |W @ x - W @ x̂| <= |W| @ (dx/2 per element).
    """
    ref64 = ref.astype(np.float64)
    xhat, dx = quantize_q8(x)
    want_q = ref64 @ xhat
    scale = np.abs(want_q).max() + 1e-6
    assert np.abs(got - want_q).max() / scale < 1e-5, w.name
    bound = np.abs(ref64) @ np.repeat(dx.astype(np.float64) / 2, 32) + 1e-5 * scale
    assert np.all(np.abs(got - ref64 @ x) <= bound), w.name


def check_products(w: WeightMatrix, ref: np.ndarray, rng: np.random.Generator) -> None:
    x = rng.standard_normal(w.cols).astype(np.float32)
    xs = rng.standard_normal((5, w.cols)).astype(np.float32)
    want_v = ref.astype(np.float64) @ x
    want_m = xs.astype(np.float64) @ ref.astype(np.float64).T
    scale_v = np.abs(want_v).max() + 1e-6
    scale_m = np.abs(want_m).max() + 1e-6
    assert np.abs(matvec(w, x, exact=True) - want_v).max() / scale_v < 1e-5, w.name
    assert np.abs(matmul(w, xs, exact=True) - want_m).max() / scale_m < 1e-5, w.name
    ids = np.array([0, w.rows - 1, w.rows // 2])
    np.testing.assert_array_equal(embedding_rows(w, ids), ref[ids])
    got = matvec(w, x)
    got_m = matmul(w, xs)
    if w.ggml_type in PACKED_TYPES:
        assert w.packed is not None, w.name
        check_int8_matvec(w, ref, x, got)
        for i in range(len(xs)):  # prefill: every token as in decode
            check_int8_matvec(w, ref, xs[i], got_m[i])
            np.testing.assert_array_equal(got_m[i], matvec(w, xs[i]))
        np.testing.assert_array_equal(matmul(w, x[None, :])[0], got)  # one token goes the decode path
    else:
        assert np.abs(got - want_v).max() / scale_v < 1e-5, w.name
        assert np.abs(got_m - want_m).max() / scale_m < 1e-5, w.name
    # once repacked, every path decodes from the packed copy: still exact
    np.testing.assert_array_equal(dequantize(w), ref)
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


def test_mxfp4_every_scale_exponent_decodes_and_packs_as_gguf() -> None:
    """Row e has E8M0 byte e in every block, e = 0..255: 2**-128 (subnormal) to 2**127 (times 12: inf, as in
    gguf), exact through the file's blocks and, once repacked, through the packed copy's bfloat16 scales."""
    rng = np.random.default_rng(39)
    rows, cols = 256, 64
    raw = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    raw = raw.reshape(rows, -1)
    with np.errstate(over="ignore"):
        ref = oracle(T.MXFP4, raw, rows, cols)
        w = WeightMatrix.from_raw("e8m0", T.MXFP4, rows, cols, raw)
        np.testing.assert_array_equal(dequantize(w), ref)
        w.prepare()
        assert w.packed is not None
        np.testing.assert_array_equal(dequantize(w), ref)
    assert np.abs(ref[0]).max() == np.float32(12 * 2.0**-128)  # the subnormal scale is not flushed to zero
    assert np.isinf(ref[255]).any()


def test_mxfp4_rows_of_an_odd_number_of_blocks() -> None:
    """Three 17-byte blocks a row (51 bytes): packing reads no 16-bit word of the file."""
    rng = np.random.default_rng(40)
    rows, cols = 70, 96
    raw = random_blocks(T.MXFP4, rows, cols, rng)
    w = WeightMatrix.from_raw("odd", T.MXFP4, rows, cols, raw)
    ref = oracle(T.MXFP4, raw, rows, cols)
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


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_half_formats_at_parallel_sizes(qtype: T) -> None:
    """301 x 512 halves (300 KB): the parallel decode kernel, and prefill blocks of about floats.BLOCK_ROWS rows
    that split 301 unevenly."""
    rng = np.random.default_rng(8)
    a = rng.standard_normal((301, 512)).astype(np.float32)
    raw = a.astype(np.float16) if qtype == T.F16 else (a.view(np.uint32) >> 16).astype(np.uint16)
    w = WeightMatrix.from_raw("synthetic", qtype, 301, 512, raw.view(np.uint8))
    assert w.data.nbytes >= PARALLEL_MIN_BYTES and 301 > floats.BLOCK_ROWS
    check_products(w, oracle(qtype, raw.view(np.uint8).reshape(301, -1), 301, 512), rng)


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
        n_rows = rows
        rows = min(rows, 1024)  # a slice of the big embedding matrices is enough
        data = t.data.view(np.uint8).reshape(n_rows, -1)[:rows]  # (GGUFReader's views are 2-D, cached ones flat)
        w = WeightMatrix.from_raw(t.name, t.ggml_type, rows, cols, data)
        ref = oracle(t.ggml_type, data, rows, cols)
        np.testing.assert_array_equal(dequantize(w), ref)
        check_products(w, ref, rng)
    expected = {"smollm2": {T.Q4_1, T.Q8_0}, "qwen": {T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K}}[model]
    assert expected <= seen


def test_packed_types_cover_both_models() -> None:
    assert {T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K} <= PACKED_TYPES


def test_ordered_copies_put_each_quad_once_where_the_order_says() -> None:
    assert ordered_copies([0, 1, 5, 2], raw_start=16) == ((16, 0, 8), (36, 8, 4), (24, 12, 4))
    # Q6_K: every byte of the file's ql|qh|scales lands once in q, quad j at slot SLOT[j], and `at` says where
    source = np.full(q6_k.PACKING.quant_bytes, -1)
    for raw, at, n in q6_k.PACKING.copies:
        source[at : at + n] = np.arange(raw, raw + n)
    assert sorted(source.tolist()) == list(range(q6_k.PACKING.quant_bytes))
    assert all(source[q6_k.at(k)] == k for k in range(q6_k.PACKING.quant_bytes))
    assert [source[4 * p] // 4 for p in range(len(q6_k.ORDER))] == q6_k.ORDER


def test_half_conversion_matches_the_table_for_every_bit_pattern() -> None:
    @numba.njit
    def convert(hs, out):
        for i in range(hs.shape[0]):
            out[i] = packed.h2f(hs[i])

    out = np.empty(65536, dtype=np.float32)
    convert(np.arange(65536, dtype=np.uint16), out)
    np.testing.assert_array_equal(out.view(np.uint32), F16_TABLE.view(np.uint32))


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 63, 64, 65, 200])
def test_packed_matvec_at_row_counts_around_the_group_size(qtype: T, rows: int) -> None:
    rng = np.random.default_rng(rows)
    cols = 512
    raw = random_blocks(qtype, rows, cols, rng)
    w = WeightMatrix.from_raw("ragged", qtype, rows, cols, raw)
    ref = oracle(qtype, raw, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    check_int8_matvec(w, ref, x, matvec(w, x))
    np.testing.assert_array_equal(dequantize(w), ref)


def test_int8_path_on_zero_and_tiny_activations() -> None:
    """All-zero blocks of x have dx = 0 and must give exact zeros, not NaNs."""
    rng = np.random.default_rng(5)
    raw = random_blocks(T.Q4_1, 64, 256, rng)
    w = WeightMatrix.from_raw("zeros", T.Q4_1, 64, 256, raw)
    ref = oracle(T.Q4_1, raw, 64, 256)
    x = np.zeros(256, dtype=np.float32)
    np.testing.assert_array_equal(matvec(w, x), np.zeros(64, dtype=np.float32))
    x[37] = 1e-30
    x[200] = -3.0
    check_int8_matvec(w, ref, x, matvec(w, x))
    x[100] = np.nan  # must not vanish in the rounding to int8
    assert np.isnan(matvec(w, x)).all()
    x[100] = np.inf
    assert not np.isfinite(matvec(w, x)).any()


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda t: t.name)
def test_prefill_many_tokens_equals_decode_per_token(qtype: T) -> None:
    """matmul runs tokens 16 to a parallel item: a count that is not a multiple checks the edges."""
    rng = np.random.default_rng(int(qtype) + 100)
    rows, cols = 130, 512
    raw = random_blocks(qtype, rows, cols, rng)
    w = WeightMatrix.from_raw("prefill", qtype, rows, cols, raw)
    ref = oracle(qtype, raw, rows, cols)
    xs = rng.standard_normal((37, cols)).astype(np.float32)
    got = matmul(w, xs)
    assert got.shape == (37, rows)
    for i in range(len(xs)):
        np.testing.assert_array_equal(got[i], matvec(w, xs[i]))
    check_int8_matvec(w, ref, xs[-1], got[-1])


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda t: t.name)
def test_multi_token_kernels_equal_decode_per_token(qtype: T) -> None:
    """matmul decodes each block once for packed.TILE tokens: every token's row must be matvec's, bit for bit.

    A short pass (up to packed.SHORT_MAX tokens) runs TILE at a time, the last few through the one-token kernel:
    2 and 3 are padded to one tile, 5 is a tile and one more, 8 two tiles, 17 four tiles and one more. Longer
    ones go packed.PER_ITEM to an item: 18 leaves a 2-token item, 37 a 5-token one (a tile and one more). Row
    counts that are not multiples of the group size leave a zero-padded last group.
    """
    rng = np.random.default_rng(int(qtype) + 400)
    cols = 512
    for rows in (70, 130):
        w = WeightMatrix.from_raw("tiles", qtype, rows, cols, random_blocks(qtype, rows, cols, rng)).prepare()
        p = w.packed
        for n_tok in (1, 2, 3, 4, 5, 8, packed.SHORT_MAX, packed.SHORT_MAX + 1, 37):
            xs = rng.standard_normal((n_tok, cols)).astype(np.float32)
            got = np.empty((n_tok, rows), dtype=np.float32)
            # directly: the wrapper sends one token to matvec
            packed.matmul(p.q, p.s, p.fmt, xs, got, *packed.row_buffers(*xs.shape), False)
            for i in range(n_tok):
                np.testing.assert_array_equal(got[i], matvec(w, xs[i]), err_msg=f"{rows} rows, token {i}/{n_tok}")


def test_products_of_one_input_quantize_it_once() -> None:
    """same_input reuses the int8 rows only of the very array the scratch's last product quantized: formats
    mixed (quad and pair kernels), then another array of the same shape, give each product's own result; in a
    pass of 40 rows, and in one of 3 (padded to a tile in buffers that a longer pass filled before)."""
    rng = np.random.default_rng(12)
    cols = 512
    ws = [
        WeightMatrix.from_raw(f"m{i}", qt, 96, cols, random_blocks(qt, 96, cols, rng)).prepare()
        for i, qt in enumerate((T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0))
    ]
    work = Scratch()
    for t in (40, 3):
        a, b = (rng.standard_normal((t, cols)).astype(np.float32) for _ in range(2))
        for xs in (a, b, b):
            for i, w in enumerate(ws):
                got = matmul(w, xs, scratch=work, same_input=i > 0)
                np.testing.assert_array_equal(got, matmul(w, xs.copy()), err_msg=f"{w.name}, {t} rows")
        assert work.quantized_input is b
        matmul(ws[0], a, scratch=work)
        # another array, though the caller says "same": its own rows are quantized
        np.testing.assert_array_equal(matmul(ws[1], b, scratch=work, same_input=True), matmul(ws[1], b.copy()))


def test_matvec_many_equals_separate_matvecs() -> None:
    rng = np.random.default_rng(11)
    cols = 512
    specs = [(T.Q5_0, 200), (T.Q5_0, 64), (T.Q8_0, 100), (T.Q5_1, 48), (T.Q5_0, 1)]
    ws = [
        WeightMatrix.from_raw(f"m{i}", qt, rows, cols, random_blocks(qt, rows, cols, rng))
        for i, (qt, rows) in enumerate(specs)
    ]
    x = rng.standard_normal(cols).astype(np.float32)
    outs = matvec_many(ws, x)
    assert [o.shape for o in outs] == [(rows,) for _, rows in specs]
    for w, o in zip(ws, outs, strict=True):
        np.testing.assert_array_equal(o, matvec(w, x))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not pages.is_supported(), reason="page release needs Linux madvise")
def test_prepare_releases_the_file_pages(smollm2_path) -> None:
    """Repacking must not keep both copies resident: the mapped file pages it read are dropped."""
    f = open_gguf(smollm2_path)
    t = f.tensors["token_embd.weight"]  # 49152 x 576 Q8_0, 30 MB
    cols, rows = t.shape
    w = WeightMatrix.from_raw(t.name, t.ggml_type, rows, cols, t.data)
    head = np.array(w.data[:3])
    # the packing kernel loads (tens of MB of LLVM) before the measurement, as it has when run after other tests
    WeightMatrix.from_raw("warm-up", t.ggml_type, 64, cols, np.array(w.data[:64])).prepare()
    int(w.data.sum(dtype=np.uint64))  # fault every page in
    before = _rss_bytes()
    w.prepare()
    after = _rss_bytes()
    assert w.packed is not None
    grown = after - before
    # the packed copy (30 MB) replaced the file pages (30 MB): well under half of it may remain on top
    assert grown < t.data.nbytes // 2, f"RSS grew by {grown} bytes for a {t.data.nbytes}-byte tensor"
    np.testing.assert_array_equal(embedding_rows(w, np.array([0, 1, 2])), oracle(t.ggml_type, head, 3, cols))


@pytest.mark.skipif(not pages.is_supported(), reason="resident-size check reads Linux /proc")
def test_embedding_rows_read_from_the_file_never_map_it(smollm2_path) -> None:
    """Looking rows up maps none of the table: 256 rows of 612 bytes cost their copy, not a page (or a folio) each."""
    t = open_gguf(smollm2_path).tensors["token_embd.weight"]  # 49152 x 576 Q8_0
    cols, rows = t.shape
    w = WeightMatrix.from_raw(t.name, t.ggml_type, rows, cols, t.data)
    reader = pages.FileRows.of(w.data)
    assert reader is not None
    ids = np.random.default_rng(0).permutation(rows)[:256]
    before = _rss_bytes()
    got = reader.take(ids)
    grown = _rss_bytes() - before
    assert grown < 600_000, f"RSS grew by {grown} bytes for {got.nbytes} bytes of rows"  # through the map: >= 1 MB
    np.testing.assert_array_equal(got, w.data[ids])
    np.testing.assert_array_equal(embedding_rows(w, ids, reader), embedding_rows(w, ids))
    with pytest.raises(IndexError):
        reader.take(np.array([rows]))


def test_file_rows_keep_reading_the_file_that_was_mapped(tmp_path) -> None:
    path = tmp_path / "table.bin"
    table = np.arange(64 * 16, dtype=np.uint16).reshape(64, 16)
    path.write_bytes(b"head" + table.tobytes())
    view = np.memmap(path, mode="r", offset=4, dtype=np.uint16, shape=(64, 16))[8:40]
    reader = pages.FileRows.of(view)
    assert reader is not None
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(bytes(4 + table.nbytes))
    replacement.replace(path)  # another file under the same name
    np.testing.assert_array_equal(reader.take(np.array([0, 31, 5])), table[8:40][[0, 31, 5]])
    assert pages.FileRows.of(table) is None  # not a file mapping
    assert pages.FileRows.of(np.memmap(path, mode="c", dtype=np.uint16, shape=(2, 8))) is None  # copy-on-write


def _present_pages(a: np.ndarray) -> int:
    """How many pages under `a` are mapped into this process now (/proc/self/pagemap's present bit)."""
    page = 4096
    lo, hi = a.ctypes.data // page, -(-(a.ctypes.data + a.nbytes) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo * 8)
        entries = np.frombuffer(f.read((hi - lo) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not pages.is_supported(), reason="page residency is read from Linux /proc")
def test_file_copy_reads_the_file_without_mapping_it(tmp_path) -> None:
    """A small tensor between big ones is copied with pread: none of the mapping's pages (nor the 64 KB the kernel
    maps around a fault) become resident; anything that is not a read-only file mapping is simply copied."""
    path = tmp_path / "model.bin"
    data = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    mapping = np.memmap(path, mode="r")
    vector = mapping[(2 << 20) + 100 : (2 << 20) + 100 + 2304].view(np.float32)  # a norm's 576 floats
    got = pages.file_copy(vector)
    np.testing.assert_array_equal(got, data[(2 << 20) + 100 : (2 << 20) + 2404].view(np.float32))
    assert got.base is None or not isinstance(got.base, np.memmap)
    assert _present_pages(mapping) == 0
    np.testing.assert_array_equal(np.asarray(vector), got)  # through the mapping: now it is mapped
    assert _present_pages(mapping) > 0
    anonymous = np.arange(10, dtype=np.float32)
    copied = pages.file_copy(anonymous)
    np.testing.assert_array_equal(copied, anonymous)
    assert copied is not anonymous


@pytest.mark.skipif(not pages.is_supported(), reason="page residency is read from Linux /proc")
def test_a_packed_weight_gives_its_file_pages_back_again(tmp_path) -> None:
    """release_file_pages drops the file pages under a packed weight that came back after packing (reading the
    next matrix faults in the 64 KB around each page); a weight not yet packed keeps its pages."""
    rows, cols = 256, 512
    raw = random_blocks(T.Q8_0, rows, cols, np.random.default_rng(5))
    path = tmp_path / "weights.bin"
    path.write_bytes(raw.tobytes() * 2)
    mapping = np.memmap(path, mode="r").reshape(2 * rows, -1)
    first, second = (WeightMatrix.from_raw(f"w{i}", T.Q8_0, rows, cols, mapping[i * rows : (i + 1) * rows])
                     for i in range(2))  # fmt: skip
    x = np.random.default_rng(6).standard_normal(cols).astype(np.float32)
    expected = matvec(WeightMatrix.from_raw("copy", T.Q8_0, rows, cols, raw.copy()), x)
    first.prepare()
    int(first.data.sum(dtype=np.uint64))  # its pages back, as a neighbour's fault-around brings them
    int(second.data.sum(dtype=np.uint64))
    assert _present_pages(first.data) > 0
    first.release_file_pages()
    second.release_file_pages()  # not packed: nothing to give back
    assert _present_pages(first.data) == 0
    assert _present_pages(second.data) > 0
    np.testing.assert_array_equal(matvec(first, x), expected)  # the packed copy still serves the products


def test_release_never_touches_anonymous_memory() -> None:
    a = np.arange(1 << 20, dtype=np.uint8)
    assert not pages.release(a)
    np.testing.assert_array_equal(a, np.arange(1 << 20, dtype=np.uint8))


@pytest.mark.skipif(not pages.is_supported(), reason="resident-size check reads Linux /proc")
def test_scratch_buffers_come_resident() -> None:
    """A buffer that parallel loops will fill is faulted in when allocated (one call), not page by page in them:
    RSS holds it before anything is written, and what is written stays."""
    before = _rss_bytes()
    a = pages.resident_empty(3 << 20, np.float32)  # 12 MB
    grown = _rss_bytes() - before
    assert grown >= a.nbytes * 0.95, f"RSS grew by {grown} bytes for a {a.nbytes}-byte buffer"
    a[:] = 1.5
    assert a.dtype == np.float32 and a.shape == (3 << 20,) and (a == 1.5).all()
    assert pages.resident_empty(0, np.float32).shape == (0,)


def test_activations_quantize_as_stated() -> None:
    """x̂ = dx · xq per 32 values: dx = max|x| / 127, xq = x / dx rounded half to even (float32 throughout); a
    block of zeros gives dx = 0 and xq = 0, one holding a nan or an inf gives dx = nan; xsum sums xq per 16."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(32 * 40) * rng.choice([1e-30, 1e-3, 1.0, 1e30], 32 * 40)).astype(np.float32)
    x[:32] = np.arange(32, dtype=np.float32) - 16.5  # no ties: then exact .5 ties, to even and to odd
    x[32:64] = np.concatenate([[127.0], np.arange(31, dtype=np.float32) / 2 - 7.5]).astype(np.float32)
    x[64:96] = 0.0
    x[96:128] = -x[32:64]
    x[200], x[300], x[400] = np.nan, np.inf, -np.inf
    xq, dx, xsum = packed.quantize_x(x)
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    finite = np.isfinite(blocks).all(axis=1)
    want_dx = np.where(finite, amax / np.float32(127.0), np.float32(np.nan)).astype(np.float32)
    np.testing.assert_array_equal(dx, want_dx)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(want_dx > 0, np.float32(1.0) / want_dx, np.float32(0.0)).astype(np.float32)
    want_xq = np.round(blocks[finite] * inv[finite, None]).astype(np.int8)
    np.testing.assert_array_equal(xq[finite], want_xq)
    assert (xq[1, 1:] == np.round(np.arange(31) / 2 - 7.5)).all() and xq[1, 0] == 127  # halves to even
    np.testing.assert_array_equal(xsum[finite], want_xq.reshape(-1, 2, 16).astype(np.int32).sum(axis=2))
    assert not xq[2].any() and dx[2] == 0


def _packed_weight(qtype: T, rows: int, cols: int, seed: int) -> tuple[WeightMatrix, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, rows, cols, rng)
    w = WeightMatrix.from_raw("packed", qtype, rows, cols, raw).prepare()
    return w, oracle(qtype, raw, rows, cols), rng.standard_normal(cols).astype(np.float32)


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda t: t.name)
def test_simd_kernels_match_the_reference_loops(qtype: T) -> None:
    """simd.py's block kernels and packed.py's plain loops: the same integer sums, float32 apart at most."""
    w, ref, x = _packed_weight(qtype, 200, 1024, int(qtype) + 200)
    p = w.packed
    fast = np.empty(w.rows, dtype=np.float32)
    slow = np.empty(w.rows, dtype=np.float32)
    packed.matvec(p.q, p.s, p.fmt, x, fast)
    packed.matvec_reference(p.q, p.s, p.fmt, x, slow)
    assert np.abs(fast - slow).max() <= 1e-6 * np.abs(slow).max()
    check_int8_matvec(w, ref, x, slow)


def test_float_products_switch_every_product_to_the_float_path() -> None:
    w, ref, x = _packed_weight(T.Q4_1, 100, 512, 7)
    xs = np.random.default_rng(8).standard_normal((3, 512)).astype(np.float32)
    want_v = ref.astype(np.float64) @ x
    want_m = xs.astype(np.float64) @ ref.astype(np.float64).T
    with float_products():
        assert np.abs(matvec(w, x) - want_v).max() < 1e-5 * np.abs(want_v).max()
        assert np.abs(matmul(w, xs) - want_m).max() < 1e-5 * np.abs(want_m).max()
        assert np.abs(matvec_many([w, w], x)[1] - want_v).max() < 1e-5 * np.abs(want_v).max()
    check_int8_matvec(w, ref, x, matvec(w, x))  # and back to int8 after the block


def test_read_bandwidth_probe_sums_every_part() -> None:
    """`chatapp bench`'s bandwidth probe: the parallel sum over thread parts covers the whole buffer once."""
    from engine.kernels import memory

    a = np.arange(1001, dtype=np.int64)
    for threads in (1, 2, 7):
        assert memory._sum_parts(a, np.zeros(threads, dtype=np.int64)) == a.sum()
    assert memory.read_bandwidth(1 << 20, repeats=1) > 0
