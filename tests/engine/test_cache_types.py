"""The q8_0 KV cache (engine/cache_types.py, llama.cpp's -ctk/-ctv q8_0): its quantizer against gguf-py's, and
every attention path that reads it against the float64 definition over the dequantized cache."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine import cache_types, kernels, load_model
from engine.chat import ChatSession
from engine.errors import SettingsError
from engine.kernels import attention as attention_kernels
from engine.kernels import causal_attention
from engine.kv_store import KVStore
from engine.sampling import SamplingSettings
from engine.speculative import ModelDrafter
from tests.engine.compare import assert_close_logits
from tests.engine.oracle import attention
from tests.engine.synthetic import write_tiny_model


def q8_rows(x: np.ndarray) -> np.ndarray:
    """x (..., hd) -> its q8_0 rows (..., hd/32·34) uint8, by gguf-py's quantizer (ggml's reference)."""
    return gguf.quants.quantize(x.astype(np.float32), T.Q8_0)


def dequant(rows: np.ndarray) -> np.ndarray:
    """Cached rows of either type -> float64 values, by gguf-py (q8_0) or NumPy (f16)."""
    if rows.dtype == np.uint8:
        return gguf.quants.dequantize(rows, T.Q8_0).astype(np.float64)
    return rows.astype(np.float64)


def test_quantize_rows_as_ggml() -> None:
    """The kernel's and the NumPy statement's q8_0 bytes are gguf-py's, ties and zero blocks included; the
    values come back within half a step of each block, d/2, plus the scale's rounding to a half (127·d·2⁻¹¹)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 128)) * 10.0 ** rng.integers(-4, 3, (40, 1))).astype(np.float32)
    x[3] = 0.0  # a zero block: d = 0, every q 0
    x[4, :32] = np.float32(127 / 2) * np.arange(-16, 16, dtype=np.float32) / 16  # exact halves: roundf's ties
    x[4, 0] = -127.0
    expected = q8_rows(x)
    ours = np.zeros_like(expected)
    for r in range(x.shape[0]):
        attention_kernels.quantize_q8_0(x[r], ours[r])
    np.testing.assert_array_equal(ours, expected)
    np.testing.assert_array_equal(cache_types.to_cache(np, x, "q8_0"), expected)
    back = np.empty_like(x)
    for r in range(x.shape[0]):
        attention_kernels.dequantize_q8_0(expected[r], back[r])
    np.testing.assert_array_equal(back, gguf.quants.dequantize(expected, T.Q8_0))
    np.testing.assert_array_equal(cache_types.to_floats(np, expected), back)
    d = np.abs(x).reshape(40, 4, 32).max(axis=2, keepdims=True) / 127
    normal = d >= 2.0**-14  # a scale below float16's normals loses more than 2⁻¹¹ of itself
    err = np.abs(back - x).reshape(40, 4, 32)
    assert normal.sum() > 100 and np.all((err <= d * (0.5 + 127 * 2.0**-11) * (1 + 1e-6)) | ~normal)


def _caches(rng: np.random.Generator, n_kv: int, n_ctx: int, hd: int, type_k: str, type_v: str):
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    kc = q8_rows(k) if type_k == "q8_0" else k.astype(np.float16)
    vc = q8_rows(v) if type_v == "q8_0" else v.astype(np.float16)
    return kc, vc


TYPES = [("q8_0", "q8_0"), ("q8_0", "f16"), ("f16", "q8_0")]


@pytest.mark.parametrize(("type_k", "type_v"), TYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_attend_one_reads_q8_0(type_k: str, type_v: str, threads: int) -> None:
    """The one-token kernel (decode.layer's) over a q8_0 cache: the definition over the dequantized rows."""
    rng = np.random.default_rng(threads)
    n_head, n_kv, hd, n_ctx, pos = 12, 2, 128, 600, 590  # the 1.5B's heads; long enough to split the threads
    q = rng.standard_normal(n_head * hd).astype(np.float32)
    kc, vc = _caches(rng, n_kv, n_ctx, hd, type_k, type_v)
    out = np.empty(n_head * hd, dtype=np.float32)
    attention_kernels.attend_one(q, kernels.cache_bits(kc), kernels.cache_bits(vc), pos, n_head, 0.09, 0, 0.0,
                                 threads, out)  # fmt: skip
    ref = attention(q.reshape(1, n_head, hd), dequant(kc[:, : pos + 1]), dequant(vc[:, : pos + 1]), pos, 0, 0.09)
    np.testing.assert_allclose(out, ref[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("parallel_blas", [True, False], ids=["sgemm-in-kernel", "numpy-fallback"])
@pytest.mark.parametrize(("t", "start", "rowwise"), [(40, 0, False), (17, 40, False), (5, 3, False), (9, 30, True)])
def test_causal_attention_reads_q8_0(t: int, start: int, rowwise: bool, parallel_blas: bool, monkeypatch) -> None:
    """The prompt path (blocks over BLAS, the NumPy fallback, short passes and --deterministic's rows) over a
    q8_0 ring with a window and a soft-cap, K and V of each type: the definition over the dequantized keys."""
    if not parallel_blas:
        monkeypatch.setattr(kernels.products, "_sgemm_address", [0])
    rng = np.random.default_rng(t + start)
    n_head, n_kv, hd, rows, window, cap, scale = 4, 2, 64, 48, 24, 2.0, 0.3
    end = start + t
    lo = max(0, start - window + 1)
    for type_k, type_v in TYPES:
        k, v = _caches(rng, n_kv, end, hd, type_k, type_v)  # every position's row, in order
        kc, vc = np.zeros((n_kv, rows, k.shape[2]), k.dtype), np.zeros((n_kv, rows, v.shape[2]), v.dtype)
        for p in range(end):  # written in order: the ring keeps the latest
            kc[:, p % rows], vc[:, p % rows] = k[:, p], v[:, p]
        q = rng.standard_normal((t, n_head, hd)).astype(np.float32)
        ours = causal_attention(q, kc, vc, start, scale, window, cap, rowwise=rowwise)
        ref = attention(q, dequant(k[:, lo:]), dequant(v[:, lo:]), start, lo, scale, window, cap)
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5, err_msg=f"K {type_k}, V {type_v}")


def test_rope_into_cache_stores_q8_0() -> None:
    """The prompt path's store: k and v rows quantized as gguf-py quantizes them, at row p % rows."""
    rng = np.random.default_rng(1)
    t, n_head, n_kv, hd, rows, start = 5, 4, 2, 64, 8, 6
    q = rng.standard_normal((t, n_head * hd)).astype(np.float32)
    k = rng.standard_normal((t, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((t, n_kv * hd)).astype(np.float32)
    kc = np.zeros((n_kv, rows, hd // 32 * 34), np.uint8)
    vc = np.zeros((n_kv, rows, hd), np.float16)
    none = np.zeros((t, 0), np.float32)
    kernels.rope_into_cache(q, k, v, kc, vc, start, none, none, (n_head, n_kv, hd, 0, False))
    for i in range(t):
        row = (start + i) % rows
        np.testing.assert_array_equal(kc[:, row], q8_rows(k[i].reshape(n_kv, hd)))
        np.testing.assert_array_equal(vc[:, row], v[i].reshape(n_kv, hd).astype(np.float16))


def test_cache_type_names() -> None:
    assert cache_types.check_cache_type(" Q8_0 ") == "q8_0"
    with pytest.raises(SettingsError, match=r"cache type K 'q4_0': expected one of f16, q8_0"):
        cache_types.check_cache_type("q4_0", "cache type K")
    with pytest.raises(SettingsError, match="multiple of 32"):
        cache_types.row_layout("q8_0", 16)
    assert cache_types.row_bytes("q8_0", 128) == 136 and cache_types.row_bytes("f16", 128) == 256


# ---- the whole model on a q8_0 cache: a tiny Qwen3 (head size 32), every path ------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("q8") / "qwen3.gguf", "qwen3", seed=3).path


@pytest.fixture(scope="module")
def q8_model(tiny_qwen3: Path):
    return load_model(tiny_qwen3, n_ctx=96, cache_type_k="q8_0", cache_type_v="q8_0", compile_kernels=False)


IDS = [40 + (i * 7) % 50 for i in range(40)]


def decoded(model, ids: list[int], first: int) -> np.ndarray:
    """Logits of ids[first:], each token decoded alone after a prompt of ids[:first]: (len - first, n_vocab)."""
    session = model.session()
    session.eval(ids[:first])
    return np.array([session.eval([t]) for t in ids[first:]])


def test_the_cache_is_q8_0_and_53_percent_of_f16(tiny_qwen3: Path, q8_model) -> None:
    f16_model = load_model(tiny_qwen3, n_ctx=96, compile_kernels=False)
    q8, f16 = q8_model.session().cache, f16_model.session().cache
    assert (q8.k.dtype, q8.v.dtype, q8.k.shape[3], f16.k.shape[3]) == (np.uint8, np.uint8, 34, 32)
    assert q8.nbytes * 32 == f16.nbytes * 17
    # Prompt (BLAS blocks) and one-token paths on the q8_0 cache agree, and stay near the f16 cache's logits: a
    # cache read as the wrong type, or not read, moves them by far more than the int8 bound.
    prompt = q8_model.logits(IDS)  # (40, n_vocab)
    for ours, fresh in zip(decoded(q8_model, IDS, 30), prompt[30:], strict=True):
        assert_close_logits(ours, fresh)
    for ours, fresh in zip(prompt, f16_model.logits(IDS), strict=True):
        assert_close_logits(ours, fresh)


def test_rows_deterministic_and_speculative_are_decoding_bit_for_bit(q8_model) -> None:
    """Draft checks (eval_all) and --deterministic prompts compute each row as decoding it alone, on q8_0 too."""
    one_by_one = decoded(q8_model, IDS, 1)
    session = q8_model.session()
    session.eval(IDS[:1])
    np.testing.assert_array_equal(session.eval_all(IDS[1:]), one_by_one)
    q8_model.deterministic = True
    try:
        session = q8_model.session()
        session.eval(IDS[:1])
        np.testing.assert_array_equal(session.eval(IDS[1:]), one_by_one[-1])
    finally:
        q8_model.deterministic = False
    greedy = SamplingSettings(temperature=0.0, max_tokens=16)
    plain = [e.token_id for e in list(ChatSession(q8_model, greedy).stream_completion(IDS[:20]))[:-1]]
    drafter = ModelDrafter(q8_model, q8_model, draft_max=4, p_min=0.0)  # its own draft: every guess is kept
    events = list(ChatSession(q8_model, greedy, drafter=drafter).stream_completion(IDS[:20]))
    assert [e.token_id for e in events[:-1]] == plain and events[-1].draft_accepted > 0


def test_device_offload_stores_and_reads_q8_0(tiny_qwen3: Path, q8_model) -> None:
    """The device path (NumPy backend): its cache is q8_0 bytes, its logits the CPU's on q8_0."""
    model = load_model(tiny_qwen3, n_ctx=96, device="numpy", gpu_layers=1, cache_type_k="q8_0",
                       cache_type_v="q8_0", compile_kernels=False)  # fmt: skip
    session = model.session()
    session.eval(IDS[:30])
    assert session.cache.device.k[0].dtype == np.uint8 and session.cache.device.v[0].shape[2] == 34
    for ours, fresh in zip(np.array([session.eval([t]) for t in IDS[30:]]), q8_model.logits(IDS)[30:], strict=True):
        assert_close_logits(ours, fresh)


def test_a_saved_cache_records_its_type_and_resumes_only_into_its_type(tiny_qwen3: Path, q8_model, tmp_path) -> None:
    store = KVStore(tmp_path / "kv", 1 << 30)
    session = q8_model.session()
    session.eval(IDS[:30])
    path = store.save(session, "model", "template")
    assert path is not None
    assert [e.cache_types for e in store.entries()] == [("q8_0", "q8_0")]
    resumed = q8_model.session()
    assert store.restore(resumed, "model", "template", IDS) == 30
    np.testing.assert_array_equal(resumed.cache.k[:, :, :30], session.cache.k[:, :, :30])
    np.testing.assert_array_equal(resumed.eval(IDS[30:]), session.eval(IDS[30:]))
    f16_session = load_model(tiny_qwen3, n_ctx=96, compile_kernels=False).session()
    assert store.restore(f16_session, "model", "template", IDS) == 0  # another type: the prompt is evaluated
    assert f16_session.n_past == 0 and path.exists()
    mixed = load_model(tiny_qwen3, n_ctx=96, cache_type_k="q8_0", compile_kernels=False).session()
    assert store.restore(mixed, "model", "template", IDS) == 0
    # Even a file whose listing is bypassed is never read as another type.
    assert store._read(path, f16_session, "model", "template") is None
