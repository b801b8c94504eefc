"""The one-call decode path (engine/kernels/decode.py) against the reference NumPy forward pass."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import njit

from engine import cache_types, kernels, load_model
from engine.kernels import WeightMatrix, causal_attention, decode, one_token
from engine.kernels import attention as attention_kernels
from tests.engine.compare import assert_close_logits
from tests.engine.oracle import attention, half_round, silu
from tests.engine.synthetic import write_tiny_model
from tests.engine.test_kernels import random_blocks


def test_round_to_half_matches_numpy_float16() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 20000),
            np.float32([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 6.1e-5, 5.96e-8, 2.98e-8, 8.9e-8, 1e-10]),
            # exact ties between float16 neighbours: 1 + (2k+1)·2^-11
            (1.0 + (2 * np.arange(64) + 1) * 2.0**-11).astype(np.float32),
        ]
    ).astype(np.float32)
    ours = values.copy()
    decode.round_to_half(ours)
    with np.errstate(over="ignore"):  # 65520 and up become inf, as they must
        expected = half_round(values)
    np.testing.assert_array_equal(ours, expected)


def test_exp_matches_numpy() -> None:
    x = -np.linspace(0, 100, 20001, dtype=np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)  # the inlined function, through a jitted caller
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(out - ref) / np.maximum(ref, 1e-38)
    assert rel[x > -87].max() < 2e-7
    assert np.all(out[x < -88] < 1e-37)


@njit
def _gated_ffn(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, out, parallel_min_bytes):
    decode.gated_ffn(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, out, parallel_min_bytes)


@pytest.mark.parametrize(
    ("ffn_kind", "d_ff", "down_type", "bias"),
    [(0, 160, T.Q8_0, False), (1, 160, T.Q4_0, True), (0, 512, T.Q6_K, True)],
    ids=["swiglu-partial-group", "geglu-bias", "swiglu-k-quant-down"],
)
def test_gated_ffn_in_two_launches_gives_the_stepwise_result_bit_for_bit(
    ffn_kind: int, d_ff: int, down_type: T, bias: bool
) -> None:
    """decode.gated_ffn computes gate and up, the bias, the activation and the down projection's quantized input
    in one parallel launch, a row group at a time: every value must come out as the products, the activation
    over the whole vector and the down projection's own quantization give it (d_ff 160: the last 64-row group
    holds 32 rows)."""
    rng = np.random.default_rng(d_ff + ffn_kind)
    d = 256

    def weight(qtype: T, rows: int, cols: int) -> tuple:
        return one_token._weight(WeightMatrix.from_raw("w", qtype, rows, cols, random_blocks(qtype, rows, cols, rng)))

    w_gate, w_up, w_down = weight(T.Q4_K, d_ff, d), weight(T.Q5_K, d_ff, d), weight(down_type, d, d_ff)
    b_up = rng.standard_normal(d_ff).astype(np.float32) if bias else np.zeros(0, dtype=np.float32)
    h = rng.standard_normal(d).astype(np.float32)
    gelu = attention_kernels.gelu_table()
    stepwise, fused, serial = (np.empty(d, dtype=np.float32) for _ in range(3))
    decode.gated_ffn_each(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, stepwise, 0)
    _gated_ffn(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, fused, 0)  # every product parallel: fused
    _gated_ffn(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, serial, 1 << 40)  # too small to share
    np.testing.assert_array_equal(fused, stepwise)
    np.testing.assert_array_equal(serial, stepwise)
    assert np.isfinite(stepwise).all() and np.abs(stepwise).max() > 0


@njit
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = attention_kernels.exp_nonpositive(x[i])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n_pos", [1, 7, 300])
def test_attend_matches_reference_attention(n_pos: int, threads: int) -> None:
    rng = np.random.default_rng(n_pos)
    n_head, n_kv, hd, n_ctx = 9, 3, 64, 320
    q = rng.standard_normal(n_head * hd).astype(np.float32)
    kc = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float16)  # the cache holds float16
    vc = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float16)
    out = np.empty(n_head * hd, dtype=np.float32)
    scale = float(1 / np.sqrt(hd))
    attention_kernels.attend_one(
        q, kc.view(np.uint16), vc.view(np.uint16), n_pos - 1, n_head, scale, 0, 0.0, threads, out
    )
    k32, v32 = kc[:, :n_pos].astype(np.float32), vc[:, :n_pos].astype(np.float32)
    ref = attention(q.reshape(1, n_head, hd), k32, v32, n_pos - 1)[0]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("hd", [64, 96, 128, 256])
def test_attend_reads_groups_of_any_size_as_the_reference(hd: int, cache_type: str) -> None:
    """The tiled kernel runs a kv head's query heads four, two or one at a time and pads a row to whole
    registers: every group size from 1 to 8, head sizes that are and are not a multiple of the padding, a
    last tile part-filled, a window and a soft-cap must all give the definition's result."""
    rng = np.random.default_rng(hd)
    n_kv, n_ctx = 2, 160
    for group in range(1, 9):
        n_head = group * n_kv
        q = rng.standard_normal(n_head * hd).astype(np.float32)
        keys, values = (rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32) for _ in range(2))
        kc, vc = (cache_types.to_cache(np, x, cache_type) for x in (keys, values))
        k32, v32 = (cache_types.to_floats(np, c) for c in (kc, vc))
        for pos, window, cap in [(0, 0, 0.0), (36, 0, 0.0), (150, 0, 30.0), (150, 40, 0.0)]:
            out = np.empty(n_head * hd, dtype=np.float32)
            attention_kernels.attend_one(
                q, kernels.cache_bits(kc), kernels.cache_bits(vc), pos, n_head, 0.1, window, cap, 2, out
            )
            ref = attention(q.reshape(1, n_head, hd), k32[:, : pos + 1], v32[:, : pos + 1], pos, scale=0.1,
                            window=window, softcap=cap)[0]  # fmt: skip
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5, err_msg=f"group {group}, pos {pos}")


@pytest.mark.parametrize(("n_head", "n_kv", "hd"), [(12, 2, 128), (4, 1, 256), (9, 3, 64)])
def test_attend_on_several_threads_gives_the_serial_result_bit_for_bit(n_head: int, n_kv: int, hd: int) -> None:
    """Long contexts split the heads between threads (per kv head, or per part of one's query heads): each
    head's arithmetic must not change, whatever the split, the window or the soft-cap."""
    rng = np.random.default_rng(n_head)
    n_ctx = 1200
    q = rng.standard_normal(n_head * hd).astype(np.float32)
    kc = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float16).view(np.uint16)
    for pos, window, cap in [(1100, 0, 0.0), (1100, 512, 0.0), (700, 0, 50.0), (40, 0, 0.0)]:
        n_pos = pos + 1 - max(0, pos - window + 1) if window else pos + 1
        assert n_pos * n_head * hd >= attention_kernels._PARALLEL_ATTEND_MIN  # parallel
        outs = []
        for threads in (1, 2, 3):
            out = np.empty(n_head * hd, dtype=np.float32)
            attention_kernels.attend_one(q, kc, vc, pos, n_head, 0.1, window, cap, threads, out)
            outs.append(out)
        assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


@pytest.mark.parametrize("parallel_blas", [True, False], ids=["sgemm-in-kernel", "numpy-fallback"])
@pytest.mark.parametrize(("t", "start"), [(1, 0), (5, 0), (64, 0), (17, 40), (1, 200)])
def test_causal_attention_matches_reference(t: int, start: int, parallel_blas: bool, monkeypatch) -> None:
    if parallel_blas:
        assert kernels.blas_sgemm_address(), "NumPy's BLAS should provide a 64-bit-integer sgemm here"
    else:
        monkeypatch.setattr(kernels.products, "_sgemm_address", [0])
    rng = np.random.default_rng(t + start)
    n_head, n_kv, hd, n_ctx = 14, 2, 64, 256
    q = rng.standard_normal((t, n_head, hd)).astype(np.float32)
    kc = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float16)
    vc = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float16)
    ours = causal_attention(q, kc, vc, start)
    ref = attention(q, kc[:, : start + t].astype(np.float32), vc[:, : start + t].astype(np.float32), start)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("parallel_blas", [True, False], ids=["sgemm-in-kernel", "numpy-fallback"])
@pytest.mark.parametrize(("t", "start"), [(1, 0), (1, 57), (5, 3), (6, 50)])
def test_sliding_window_softcap_and_ring(t: int, start: int, parallel_blas: bool, monkeypatch) -> None:
    """Attention over a ring cache (position p in row p % 16) with a window of 8, soft-capped scores and a
    scale of its own, against the oracle over the same keys in position order."""
    if not parallel_blas:
        monkeypatch.setattr(kernels.products, "_sgemm_address", [0])
    rng = np.random.default_rng(t + start)
    n_head, n_kv, hd, rows, window, cap, scale = 4, 2, 32, 16, 8, 2.0, 0.3
    end = start + t
    q = rng.standard_normal((t, n_head, hd)).astype(np.float32)
    k = rng.standard_normal((n_kv, end, hd)).astype(np.float16)  # every position's key, in order
    v = rng.standard_normal((n_kv, end, hd)).astype(np.float16)
    kc = np.zeros((n_kv, rows, hd), dtype=np.float16)
    vc = np.zeros((n_kv, rows, hd), dtype=np.float16)
    for p in range(end):  # written in order, as the forward pass does: the ring keeps the latest
        kc[:, p % rows], vc[:, p % rows] = k[:, p], v[:, p]
    ours = causal_attention(q, kc, vc, start, scale, window, cap)
    lo = max(0, start - window + 1)
    k32, v32 = k[:, lo:].astype(np.float32), v[:, lo:].astype(np.float32)
    np.testing.assert_allclose(ours, attention(q, k32, v32, start, lo, scale, window, cap), rtol=1e-4, atol=1e-5)


def _reference_eval(session, ids: list[int]) -> np.ndarray:
    """session.eval(ids) with single tokens on the reference NumPy path instead of the one-call layer."""
    session.model.fused_decode = False
    try:
        return session.eval(ids)
    finally:
        session.model.fused_decode = True


FUSED_BOUND = 0.04  # see test_fused_decode_matches_the_reference_path


def check_fused_logits(model):  # -> (fused session, reference session)
    """Six tokens decoded on the fused path and on the reference path: logits within FUSED_BOUND at each."""
    prompt = model.tokenize("The capital of France is Paris. The capital of Italy is")
    assert model._fast_layers() is not None, "every real model must take the fused path"
    fused, ref = model.session(), model.session()
    fused.eval(prompt)
    _reference_eval(ref, prompt)
    tok = int(model.tokenize(" Rome", special=False)[0])
    for _ in range(6):
        a = fused.eval([tok])
        b = _reference_eval(ref, [tok])
        assert_close_logits(a, b, FUSED_BOUND)
        tok = int(b.argmax())
    return fused, ref


@pytest.mark.parametrize("model_name", ["smollm2_model", "qwen_model", "gemma3_model"])
def test_fused_decode_matches_the_reference_path(model_name: str, request) -> None:
    """Token by token, the fused path and the reference path give the same logits to int8-rounding noise.

    Measured (6 steps): 2.5% of the logits' spread on SmolLM2 when the reference path's norms ran in NumPy; on an
    Intel Xeon (family 6 model 207, AVX-512 VNNI, AMX, 2 threads; 2026-12-06) 0 on SmolLM2, Qwen 0.5B and Gemma 3,
    the same logits and keys to the bit. Bound FUSED_BOUND (1.6x the older 2.5%, for CPUs whose float sums still
    differ between the paths), half compare.INT8_BOUND."""
    model = request.getfixturevalue(model_name)
    fused, ref = check_fused_logits(model)
    # Both caches hold f16-rounded keys/values of the same positions, equal to rounding noise: measured 0 on the
    # Xeon above for the three models; the bound is 10x float16's relative rounding (2**-11 ~ 0.05%) at the max.
    n = fused.n_past
    k_fused, k_ref = (np.stack([k[:, :n] for k in c.cache.k]).astype(np.float32) for c in (fused, ref))
    assert np.abs(k_fused - k_ref).max() <= 0.005 * np.abs(k_ref).max()


@pytest.mark.parametrize("model_name", ["smollm2_model", "qwen_model", "gemma3_model", "qwen15_model"])
def test_a_short_pass_gives_plain_decodes_logits_bit_for_bit(model_name: str, request) -> None:
    """A draft's check (Session.eval_all) computes each row as decoding that token alone does: same products,
    same attention kernel, same activation loop, for passes up to kernels.SHORT_PASS tokens and past it. So
    greedy speculative decoding never leaves plain decoding, not even at a near-tie (before: rows up to 1.2
    logits apart on SmolLM2)."""
    model = request.getfixturevalue(model_name)
    prompt = model.tokenize("def merge_intervals(intervals):\n    intervals.sort()\n    out = []\n", special=False)
    plain = model.session()
    logits = plain.eval(prompt)
    tokens, rows = [], []
    for _ in range(kernels.SHORT_PASS + 7):
        tokens.append(int(logits.argmax()))
        logits = plain.eval([tokens[-1]])
        rows.append(logits)
    checked = model.session()
    checked.eval(prompt)
    for n in (2, 5, kernels.SHORT_PASS, kernels.SHORT_PASS + 7):
        checked.truncate(len(prompt))
        np.testing.assert_array_equal(checked.eval_all(tokens[:n]), np.stack(rows[:n]), err_msg=f"a pass of {n}")


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "gemma2", "gemma3", "gpt2"])
@pytest.mark.parametrize("matrix_type", [T.F16, T.BF16], ids=lambda t: t.name)
def test_fused_decode_runs_every_family(tmp_path, arch: str, matrix_type: T) -> None:
    """Every family's layers take the one-call path (F16 and BF16 weights here; the quantized ones in
    test_architectures); with float32 activations on both paths, the logits agree to float32 rounding, past
    the Gemma models' sliding window of 5."""
    tiny = write_tiny_model(tmp_path / "m.gguf", arch, matrix_type=matrix_type)
    model = load_model(tiny.path, n_ctx=64)
    assert model._fast_layers() is not None
    fused, ref = model.session(), model.session()
    for tok in (5, 17, 3, 40, 8, 99, 250, 1, 64):
        a = fused.eval([tok])
        b = _reference_eval(ref, [tok])
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_swiglu_matches_numpy() -> None:
    """The compiled SwiGLU (both signs of the gate, and gates far out where exp(-g) overflows float32) against
    the NumPy oracle's silu, in float64."""
    rng = np.random.default_rng(3)
    far = np.array([[-200.0, -88.0, 0.0, 88.0, 200.0] * 8])  # (1, 40)
    gate = np.concatenate([rng.standard_normal((3, 40)) * 4, far]).astype(np.float32)  # (4, 40)
    up = rng.standard_normal(gate.shape).astype(np.float32)
    want = silu(gate.astype(np.float64)) * up
    got = kernels.swiglu(gate, up)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)


def test_swiglu_in_place_and_apart_agree_bit_for_bit() -> None:
    """The kernel runs silu in place over gate: into gate, into up, or into a third array, the results are the
    same bits, and a caller's gate is left as it was unless it is the output."""
    rng = np.random.default_rng(4)
    gate = (rng.standard_normal((5, 700)) * 6).astype(np.float32)
    up = rng.standard_normal(gate.shape).astype(np.float32)
    kept = gate.copy()
    apart = kernels.swiglu(gate, up)
    np.testing.assert_array_equal(gate, kept)
    into_gate = kernels.swiglu(gate.copy(), up)  # out=None on a copy, then in place on it:
    g = gate.copy()
    assert kernels.swiglu(g, up, out=g) is g
    u = up.copy()
    attention_kernels.swiglu(gate.copy(), u, u)  # the one-token layer's call: out is up
    for got in (into_gate, g, u):
        np.testing.assert_array_equal(got, apart)


def test_gelu_table_is_the_formula_at_every_half() -> None:
    """gelu_half looks ggml's GGML_GELU_FP16 table up: at every float16 value and at random float32 ones it
    returns what the tanh formula gives at g rounded to float16, rounded to float16 (0 below -10, g above 10)."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    rng = np.random.default_rng(5)
    g = np.concatenate([halves, rng.uniform(-12, 12, 20_000).astype(np.float32)])
    g = g[np.isfinite(g)]
    got = kernels.geglu(g[None, :], np.ones((1, g.size), dtype=np.float32))[0]
    x = g.astype(np.float16).astype(np.float32)
    inner = np.float32(0.7978845608) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)
    y = np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner.astype(np.float64)).astype(np.float32))
    want = np.where(g <= -10, 0.0, np.where(g >= 10, g, y.astype(np.float16).astype(np.float32)))
    # NumPy's tanh and libm's may differ in the last bit of float32, which can move a float16 rounding by one
    # step at a tie's edge: allow one float16 step, on at most a few values in ten thousand.
    with np.errstate(over="ignore"):  # the spacing of float16's largest values is inf
        step = np.abs(np.spacing(want.astype(np.float16)).astype(np.float32))
    off = np.abs(got - want) > 0
    assert np.all(np.abs(got - want)[off] <= step[off])
    assert off.mean() < 1e-3
