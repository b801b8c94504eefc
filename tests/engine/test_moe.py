"""The mixture-of-experts groundwork: the qwen3moe description and config, the synthetic qwen3moe file (held to
llama.cpp's logits through the float64 reference), the expert views and the CPU router FFN (engine/moe.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import engine.kernels.experts
import engine.moe
from engine import load_model
from engine.config import ModelConfig
from engine.errors import ModelFileError
from engine.gguf_file import open_gguf
from engine.kernels import WeightMatrix, float_products, pages
from engine.moe import ExpertTensor, RouterFfn, route, router_ffn
from tests.engine.compare import FLOAT_REFERENCE_BOUND, REFERENCE_BOUNDS, assert_matches_reference
from tests.engine.synthetic import TinyModel, moe_ffn, reference_logits, write_tiny_model
from tests.engine.test_kernels import _present_pages

Q8_BOUND = 0.025  # router FFN on Q8_0 experts against float64, of the largest |value| (measured below)
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "synthetic-moe-llama-cpp.npz"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[T, TinyModel]:
    """The synthetic qwen3moe model, seed 0, F32 and Q8_0 (as benchmarks/llama_cpp_synthetic.py writes them)."""
    d = tmp_path_factory.mktemp("moe")
    return {t: write_tiny_model(d / f"qwen3moe-{t.name}.gguf", "qwen3moe", matrix_type=t) for t in (T.F32, T.Q8_0)}


def _fresh_ffn(m: TinyModel, layer: int = 0) -> RouterFfn:
    """Layer `layer`'s router FFN bound anew from the file: no expert read yet."""
    f = open_gguf(m.path)
    return RouterFfn.bind(f, ModelConfig.from_metadata(f.metadata, m.n_vocab), layer)


def test_config_reads_the_router_fields(tiny) -> None:
    f = open_gguf(tiny[T.Q8_0].path)
    cfg = ModelConfig.from_metadata(f.metadata, tiny[T.Q8_0].n_vocab)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.d_ff_exp) == (8, 2, 64)
    assert cfg.spec.moe and cfg.spec.moe_norm_weights and cfg.spec.qk_norm and cfg.spec.rope_neox
    assert not cfg.spec.qkv_bias
    assert cfg.expected_tensors()["blk.1.ffn_down_exps.weight"] == ((64, 64, 8), True)  # (d_ff_exp, d, n_expert)
    assert "blk.0.ffn_up.weight" not in cfg.expected_tensors()
    bad = dict(f.metadata, **{"qwen3moe.expert_used_count": 9})
    with pytest.raises(ModelFileError, match="expert_used_count 9 exceeds expert_count 8"):
        ModelConfig.from_metadata(bad, tiny[T.Q8_0].n_vocab)
    del bad["qwen3moe.expert_feed_forward_length"]
    with pytest.raises(ModelFileError, match="qwen3moe.expert_feed_forward_length is missing"):
        ModelConfig.from_metadata(bad, tiny[T.Q8_0].n_vocab)


@pytest.fixture(scope="module")
def llama_cpp() -> dict:
    assert GOLDEN.is_file(), f"{GOLDEN} is missing: run benchmarks/llama_cpp_synthetic.py --families qwen3moe"
    with np.load(GOLDEN) as data:
        return {key: data[key] for key in data.files}


def test_synthetic_file_is_the_one_llama_cpp_ran(tiny, llama_cpp: dict) -> None:
    for t, m in tiny.items():
        assert hashlib.sha256(m.path.read_bytes()).hexdigest() == str(llama_cpp[f"sha256/qwen3moe-{t.name}"])


def test_reference_matches_llama_cpp_on_the_f32_file(tiny, llama_cpp: dict) -> None:
    """The float64 reference's MoE (softmax, top-2, renormalised, SwiGLU experts) is llama.cpp's: on the F32 file
    max |Δ| / spread measured 4.0e-4 over the 20 positions (AVX-512), within the float bound. (The Q8_0 file is
    for the engine: llama.cpp's int8 activations flip router near-ties there, 0.19 of the spread at worst.)"""
    ids = [int(i) for i in llama_cpp["ids"]]
    ref = reference_logits(tiny[T.F32], ids)
    assert_matches_reference(llama_cpp["logits/qwen3moe-F32"], ref, FLOAT_REFERENCE_BOUND)


@pytest.mark.parametrize("matrix_type", [T.F32, T.Q8_0], ids=lambda t: t.name)
def test_qwen3moe_matches_llama_cpp(tiny, llama_cpp: dict, matrix_type: T) -> None:
    """The whole model, the prompt path and token by token, against llama.cpp's logits on the same file (20
    tokens). Measured max |Δ| / spread (AVX-512): F32 2.4-2.5e-4; Q8_0 0.010 token by token and on
    the prompt path, where int8 activations move router near-ties as llama.cpp's do. Bounds: the reference bounds."""
    ids = [int(i) for i in llama_cpp["ids"]]
    want = llama_cpp[f"logits/qwen3moe-{matrix_type.name}"]  # (20, n_vocab)
    model = load_model(tiny[matrix_type].path, n_ctx=64)
    bound = REFERENCE_BOUNDS[matrix_type.name]
    assert_matches_reference(model.logits(ids), want, bound)
    session = model.session()
    assert_matches_reference(np.stack([session.eval([i]) for i in ids]), want, bound)


def test_route_picks_the_top_k_and_renormalises() -> None:
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3], [0.5, 0.1, 0.1, 0.3]], dtype=np.float32))
    ids, w = route(logits, 2, norm_weights=True)
    np.testing.assert_array_equal(ids, [[1, 3], [0, 3]])
    np.testing.assert_allclose(w, [[4 / 7, 3 / 7], [5 / 8, 3 / 8]], rtol=1e-6)
    _, raw = route(logits, 2, norm_weights=False)
    np.testing.assert_allclose(raw, [[0.4, 0.3], [0.5, 0.3]], rtol=1e-6)


def _transcription(m: TinyModel, h: np.ndarray, layer: int) -> np.ndarray:
    """The reference's MoE block in float64, token by token, over gguf.quants.dequantize's weights."""
    return moe_ffn(m, h.astype(np.float64), f"blk.{layer}.")


@pytest.mark.parametrize("matrix_type", [T.F32, T.Q8_0], ids=lambda t: t.name)
def test_router_ffn_matches_the_numpy_transcription(tiny, matrix_type: T) -> None:
    m = tiny[matrix_type]
    h = np.random.default_rng(1).standard_normal((24, m.d)).astype(np.float32)  # (t, d)
    want = _transcription(m, h, 1)
    scale = np.abs(want).max()
    with float_products():
        exact = router_ffn(h, _fresh_ffn(m, 1))
    # Float products: float32 sums against float64; 3.1e-7 of the largest value at most over seeds 0-19, both
    # layers (F32 and Q8_0 files alike).
    assert np.abs(exact - want).max() <= 2e-6 * scale
    fast = router_ffn(h, _fresh_ffn(m, 1))
    # F32 experts run float products anyway (3.9e-7 at most, same draws); Q8_0's take int8 activations, as
    # llama.cpp's q8_0 (the router stays F32, so routing is the same): 0.012 median, 0.017 at most. +50%.
    bound = 2e-6 if matrix_type == T.F32 else Q8_BOUND
    assert np.abs(fast - want).max() <= bound * scale
    one = np.stack([router_ffn(h[i : i + 1], _fresh_ffn(m, 1))[0] for i in range(len(h))])
    np.testing.assert_array_equal(one, fast)  # a row's result does not depend on the tokens sharing its experts

    class CpuOps:  # as a layer's FFN variant, the router FFN names its op of the backend
        router_ffn = staticmethod(router_ffn)

    np.testing.assert_array_equal(_fresh_ffn(m, 1).apply(CpuOps(), h), fast)


def test_a_token_reads_only_its_chosen_experts(tiny) -> None:
    m = tiny[T.Q8_0]
    ffn = _fresh_ffn(m)
    h = np.random.default_rng(2).standard_normal((1, m.d)).astype(np.float32)
    router_ffn(h, ffn)
    ids, _ = route(h.astype(np.float64) @ m.w["blk.0.ffn_gate_inp.weight"].T, 2, True)
    assert ffn.touched() == sorted(ids[0].tolist())
    for tensor in (ffn.gate, ffn.up, ffn.down):
        for e in range(8):  # only the chosen experts were repacked; the others are still bare file views
            assert (tensor.expert(e).packed is not None) == (e in ids[0])


def _chosen(m: TinyModel, h: np.ndarray) -> tuple[list[int], list[int]]:
    """The experts 16 tokens h choose in layer 0 (by the float64 router), and how many tokens chose each."""
    ids, _ = route(h.astype(np.float64) @ m.w["blk.0.ffn_gate_inp.weight"].T, 2, True)
    chosen, counts = np.unique(ids, return_counts=True)
    assert len(chosen) > 2  # the batch spreads over several experts
    return chosen.tolist(), counts.tolist()


def test_prefill_reads_each_chosen_expert_once(tiny, monkeypatch) -> None:
    """Float experts, 16 tokens choosing 2 experts each: each expert chosen is one product per matrix, over all
    its tokens."""
    m = tiny[T.F32]
    ffn = _fresh_ffn(m)
    calls: list[tuple[str, int]] = []
    real, real_many = engine.moe.matmul, engine.moe.matvec_many

    def counting(w, xs, **kw):
        calls.append((w.name, xs.shape[0]))
        return real(w, xs, **kw)

    def counting_many(ws, x):  # an expert with a single token: gate and up in one launch
        calls.extend((w.name, 1) for w in ws)
        return real_many(ws, x)

    monkeypatch.setattr(engine.moe, "matmul", counting)
    monkeypatch.setattr(engine.moe, "matvec_many", counting_many)
    h = np.random.default_rng(3).standard_normal((16, m.d)).astype(np.float32)
    out = router_ffn(h, ffn)
    expect = [("blk.0.ffn_gate_inp.weight", 16)]
    for e, n in zip(*_chosen(m, h), strict=True):
        expect += [(f"blk.0.ffn_{k}_exps.weight[{e}]", n) for k in ("gate", "up", "down")]
    assert sorted(calls) == sorted(expect)
    np.testing.assert_allclose(out, _transcription(m, h, 0), atol=1e-4 * np.abs(out).max())


def test_prefill_of_packed_experts_is_three_launches(tiny, monkeypatch) -> None:
    """Packed experts: the gate, up and down products of every chosen expert are one launch each, each expert's
    weights read once for all its tokens; no product one expert at a time."""
    m = tiny[T.Q8_0]
    ffn = _fresh_ffn(m)
    launches: list[tuple[list[int], list[int]]] = []
    real = engine.kernels.experts.experts_matmul

    def counting(q_all, s_all, fmt, experts, starts, *rest):
        launches.append((experts.tolist(), np.diff(starts).tolist()))
        return real(q_all, s_all, fmt, experts, starts, *rest)

    monkeypatch.setattr(engine.kernels.experts, "experts_matmul", counting)
    monkeypatch.setattr(engine.moe, "matvec_many", None)  # never called
    h = np.random.default_rng(3).standard_normal((16, m.d)).astype(np.float32)
    out = router_ffn(h, ffn)
    assert launches == [_chosen(m, h)] * 3
    assert ffn.touched() == _chosen(m, h)[0]
    np.testing.assert_allclose(out, _transcription(m, h, 0), atol=Q8_BOUND * np.abs(out).max())


@pytest.mark.parametrize("t", [2, 5, 16, 37])
def test_packed_launches_give_each_token_its_own_numbers(tiny, t) -> None:
    """The grouped launches and the expert-by-expert products agree bit for bit, and each token's row is the one
    it gets alone (one-token path): the numbers never depend on which path or which other tokens."""
    m = tiny[T.Q8_0]
    ffn = _fresh_ffn(m)
    h = np.random.default_rng(t).standard_normal((t, m.d)).astype(np.float32)
    grouped = router_ffn(h, ffn)
    ids, weights = route(engine.moe.matmul(ffn.router, h, rowwise=True), ffn.n_used, ffn.norm_weights)
    one_by_one = np.zeros_like(grouped)
    engine.moe._expert_by_expert(h, ffn, ids, weights, one_by_one)
    np.testing.assert_array_equal(grouped, one_by_one)
    alone = np.concatenate([router_ffn(h[i : i + 1], ffn) for i in range(t)])
    np.testing.assert_array_equal(grouped, alone)


def test_an_expert_is_a_view_of_the_mapped_file(tiny) -> None:
    ffn = _fresh_ffn(tiny[T.Q8_0])
    w = ffn.up.expert(5)
    assert w is ffn.up.expert(5)
    assert np.shares_memory(w.data, ffn.up.data) and w.data.base is not None
    assert (w.rows, w.cols) == (64, 64) and w.data.shape == (64, 64 // 32 * 34)
    assert ffn.down.expert(7).data.ctypes.data == ffn.down.data.ctypes.data + 7 * 64 * ffn.down.data.strides[0]
    with pytest.raises(IndexError, match="expert 8 of 8"):
        ffn.gate.expert(8)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not pages.is_supported(), reason="page residency is read from Linux /proc")
def test_memory_holds_only_the_chosen_experts(tmp_path) -> None:
    """One token through 32 experts of 3 × 278 KB (Q8_0, d = d_ff_exp = 512): memory grows by the 2 chosen
    experts' packed copies, and the other experts' file pages are never mapped."""
    n, d = 32, 512
    rng = np.random.default_rng(4)
    writer = gguf.GGUFWriter(str(tmp_path / "experts.gguf"), "qwen3moe")
    writer.add_tensor("router", (rng.standard_normal((n, d)) * 0.2).astype(np.float32))
    for name in ("gate", "up", "down"):  # random Q8_0 blocks with small scales (f16 at byte 0 of each block)
        raw = rng.integers(-127, 128, size=(n * d * d // 32, 34), dtype=np.int8).view(np.uint8)
        raw[:, :2] = rng.uniform(0.001, 0.01, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
        writer.add_tensor(name, raw.reshape(n, d, -1), raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def bind() -> RouterFfn:
        ts = open_gguf(tmp_path / "experts.gguf").tensors
        r = ts["router"]
        router = WeightMatrix.from_raw(r.name, r.ggml_type, n, d, r.data)
        gate, up, down = (ExpertTensor.of(ts[k]) for k in ("gate", "up", "down"))
        return RouterFfn(router, gate, up, down, n_used=2, norm_weights=True)

    # The kernels of this size (parallel ones: a matrix over PARALLEL_MIN_BYTES) loaded or compiled beforehand
    router_ffn(np.ones((1, d), np.float32), bind())
    ffn = bind()
    expert_bytes = ffn.up.data.nbytes // n
    h = rng.standard_normal((1, d)).astype(np.float32)
    before = _rss_bytes()
    router_ffn(h, ffn)
    grown = _rss_bytes() - before
    chosen = ffn.touched()
    assert len(chosen) == 2
    assert sum(t.expert(e).nbytes for t in (ffn.gate, ffn.up, ffn.down) for e in chosen) == 6 * expert_bytes
    # The chosen experts' packed copies are 6 × 278 KB = 1.7 MB: RSS grew by 2.2 MB (a script) to 3.8 MB (here,
    # the first packing of this shape in the process); all 32 experts' copies would be 27 MB.
    assert grown < 8 << 20, f"RSS grew by {grown} bytes, one expert matrix is {expert_bytes}"
    for tensor in (ffn.gate, ffn.up, ffn.down):
        # The file pages mapped are the kernel's fault-around and page-cache folios around what was read (the
        # chosen experts, released once packed; the router before gate): at most 97 of a tensor's 2176 pages
        # measured; reading every expert maps them all.
        present = _present_pages(tensor.data)
        assert present < tensor.data.nbytes // 4096 // 4, f"{tensor.name}: {present} pages mapped"


def test_weighted_sum_adds_in_expert_order() -> None:
    """Eight experts a token: the sum is added from zero in ascending slot (expert) order, as the expert-by-expert
    path adds one expert at a time, so that both give the same float32 bits."""
    rng = np.random.default_rng(0)
    t, k, d = 5, 8, 33
    y = (rng.standard_normal((t * k, d)) * 10.0 ** rng.integers(-3, 4, (t * k, 1))).astype(np.float32)
    slots = np.sort(rng.permutation(t * k).reshape(t, k), axis=1)
    weights = rng.random((t, k)).astype(np.float32)
    expect = np.zeros((t, d), dtype=np.float32)
    for j in range(k):
        expect += weights[:, j, None] * y[slots[:, j]]
    out = np.empty((t, d), dtype=np.float32)
    engine.kernels.experts.weighted_sum(y, slots, weights, out)
    np.testing.assert_array_equal(out, expect)
