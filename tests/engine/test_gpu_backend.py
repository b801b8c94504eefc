"""The GPU offload (engine.gpu) run on the NumPy backend: the very code CuPy runs, executed on the CPU.

Decoders against gguf.quants.dequantize; the tiled product against dequantize-then-matmul; the float ops against
engine/model.py's; tiny models of every architecture against the independent reference; both real models,
fully and partly offloaded, against the CPU engine (teacher-forced) and through a multi-turn session.
"""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from engine import SettingsError, load_model
from engine import model as engine_model
from engine.gpu import NUMPY, DeviceError, offload_for, ops, pick_backend, split_layers
from engine.gpu import matrix as gpu_matrix
from engine.gpu.dequantize import DEQUANTIZERS, dequantize_rows
from engine.gpu.matrix import DeviceMatrix, matmul
from engine.kernels import SUPPORTED_TYPES, WeightMatrix, float_products
from engine.model import Model

from . import oracle
from .compare import assert_matches_reference as close
from .synthetic import reference_logits, write_tiny_model
from .test_architectures import IDS
from .test_golden import log_softmax

# Byte offsets of each block type's half-precision fields (scales, mins): random bytes there could be NaN/inf.
HALF_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.MXFP4: (),
}
E8M0_FIELDS = {T.MXFP4: (0,)}  # power-of-two scales 2**(e - 128): e from 118..123, finite values


def random_rows(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A random weight in the file encoding: uint8 (rows, row_bytes), every value finite."""
    rng = np.random.default_rng(seed)
    block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    n = rows * cols // block
    if ggml_type == T.F32:
        blocks = rng.normal(size=(n, 1)).astype(np.float32).view(np.uint8)
    elif ggml_type == T.F16:
        blocks = rng.normal(size=(n, 1)).astype(np.float16).view(np.uint8)
    elif ggml_type == T.BF16:
        blocks = (rng.normal(size=(n, 1)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
        for o in HALF_FIELDS[ggml_type]:
            blocks[:, o : o + 2] = rng.normal(0, 0.05, size=(n, 1)).astype(np.float16).view(np.uint8)
        for o in E8M0_FIELDS.get(ggml_type, ()):
            blocks[:, o] = rng.integers(118, 124, size=n)
    return np.ascontiguousarray(blocks).reshape(rows, -1)


ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)


def test_every_supported_type_has_a_dequantizer() -> None:
    assert set(DEQUANTIZERS) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_dequantizer_matches_gguf(ggml_type: T) -> None:
    cols = 512  # two K-quant super-blocks per row
    raw = random_rows(ggml_type, 24, cols, seed=ggml_type.value)
    want = dequantize(raw, ggml_type).reshape(24, cols)
    got = dequantize_rows(np, ggml_type, raw, cols)
    assert got.dtype == np.float32 and got.shape == (24, cols)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "ggml_type", [T.F32, T.BF16, T.Q4_0, T.Q5_1, T.Q3_K, T.Q4_K, T.Q6_K, T.IQ4_XS], ids=lambda t: t.name
)
def test_tiled_product_matches_dequantize_then_matmul(ggml_type: T, monkeypatch: pytest.MonkeyPatch) -> None:
    rows, cols = 70, 512
    raw = random_rows(ggml_type, rows, cols, seed=7)
    w = WeightMatrix.from_raw("w", ggml_type, rows, cols, raw.reshape(-1))
    x = np.random.default_rng(1).normal(size=(3, cols)).astype(np.float32)  # (t, cols)
    want = x @ dequantize(raw, ggml_type).reshape(rows, cols).T  # (t, rows)
    monkeypatch.setattr(gpu_matrix, "TILE_VALUES", 16 * cols)  # 16-row tiles: 4 full and a partial one
    dev = DeviceMatrix.upload(np, w)
    assert dev.raw.dtype == np.uint8 and dev.nbytes == raw.nbytes  # stays in the file encoding
    got = matmul(np, dev, x)
    assert got.shape == (3, rows)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_ops_match_the_cpu_forward_pass() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 64)).astype(np.float32)
    w, b = rng.normal(size=64).astype(np.float32), rng.normal(size=64).astype(np.float32)
    np.testing.assert_array_equal(ops.rms_norm(np, x, w, 1e-5), oracle.rms_norm(x, w, 1e-5))
    np.testing.assert_array_equal(ops.layer_norm(np, x, w, b, 1e-5), engine_model.layer_norm(x, w, b, 1e-5))
    np.testing.assert_array_equal(ops.gelu(np, x), engine_model.gelu(x))
    np.testing.assert_array_equal(ops.silu(np, x), oracle.silu(x))
    q = rng.normal(size=(5, 8, 16)).astype(np.float32)  # (t, n_head, hd)
    cos, sin = rng.normal(size=(5, 6)).astype(np.float32), rng.normal(size=(5, 6)).astype(np.float32)
    for neox in (False, True):
        np.testing.assert_array_equal(
            ops.apply_rope(np, q, cos, sin, 12, neox), oracle.apply_rope(q, cos, sin, 12, neox)
        )
    k = rng.normal(size=(2, 9, 16)).astype(np.float32)  # (n_kv, T, hd): GQA, 4 query heads per kv head
    v = rng.normal(size=(2, 9, 16)).astype(np.float32)
    for t, start in ((5, 4), (1, 8)):
        np.testing.assert_allclose(
            ops.attention(np, q[:t], k, v, start), oracle.attention(q[:t], k, v, start), rtol=1e-6, atol=1e-6
        )
    # keys from position 3 on, a window of 4, soft-capped scores at 1/hd: Gemma's variants
    for t, start in ((5, 7), (1, 11)):
        ours = ops.attention(np, q[:t], k, v, start, 3, 1 / 16, 4, 0.5)
        np.testing.assert_allclose(ours, oracle.attention(q[:t], k, v, start, 3, 1 / 16, 4, 0.5), rtol=1e-6, atol=1e-6)
    gate, up = rng.normal(size=(2, 5, 64)).astype(np.float32) * 6
    want = oracle.half_round(oracle.half_round(engine_model.gelu(oracle.half_round(gate))))
    want = np.where(gate <= -10, 0.0, np.where(gate >= 10, gate, want)) * up
    np.testing.assert_allclose(ops.geglu(np, gate, up), want, rtol=1e-6)


def test_split_layers_follows_llama_cpp_ngl() -> None:
    assert split_layers(-1, 30) == (30, True)
    assert split_layers(31, 30) == (30, True)  # n_layer + 1: the output head too
    assert split_layers(99, 30) == (30, True)
    assert split_layers(30, 30) == (30, False)
    assert split_layers(12, 30) == (12, False)
    assert split_layers(0, 30) == (0, False)


def test_cuda_without_cupy_is_a_one_line_error() -> None:
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here; this checks a machine without it")
    with pytest.raises(DeviceError, match=r"^device cuda is not usable: cupy is not installed") as e:
        pick_backend("cuda")
    assert "\n" not in str(e.value)
    assert pick_backend("auto") == (None, "no GPU: cupy is not installed; running on the CPU")
    assert pick_backend("cpu") == (None, "")
    with pytest.raises(SettingsError, match="device must be one of auto, cpu, cuda"):
        pick_backend("tpu")


# ---- tiny models of every architecture -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "gemma2", "gemma3", "gpt2"])
@pytest.mark.parametrize("matrix_type", [T.Q8_0, T.F16], ids=lambda t: t.name)
def test_tiny_models_offloaded_match_reference(tmp_path, arch: str, matrix_type: T) -> None:
    """Every architecture's path on the device: fused qkv, biases, GELU, LayerNorm, learned positions, both RoPEs."""
    tiny = write_tiny_model(tmp_path / f"{arch}.gguf", arch, matrix_type=matrix_type)
    ref = reference_logits(tiny, IDS)
    cpu = load_model(tiny.path, n_ctx=64)
    for gpu_layers in (-1, 1):  # all layers and the output; the first layer only
        model = load_model(tiny.path, n_ctx=64, device="numpy", gpu_layers=gpu_layers)
        assert model.offload is not None and model.offload.n_layers == (tiny.n_layer if gpu_layers == -1 else 1)
        assert model.offload.runs_output == (gpu_layers == -1)
        assert model.device.startswith("numpy (test backend), ")
        logits = model.logits(IDS)
        close(logits, ref)
        spread = ref.max() - ref.min()
        # The NumPy device's float products against the CPU engine's int8 ones: measured up to 0.0246 of the spread
        # (llama3 Q8_0; Q8_0 0.007-0.025, F16 <= 0.0001) on an Intel Xeon (family 6 model 207, AVX-512 VNNI,
        # AMX, 2 threads; 2026-12-06). Bound ~20% over.
        assert np.abs(logits - cpu.logits(IDS)).max() <= 0.03 * spread
        session = model.session()  # incremental, in uneven chunks, through the device cache
        for chunk in (IDS[:1], IDS[1:5], IDS[5:6], IDS[6:]):
            last = session.eval(chunk)
            close(last[None], ref[session.n_past - 1][None])


@pytest.mark.parametrize("gpu_layers", [-1, 3])
def test_sliding_window_ring_on_the_device(tmp_path, gpu_layers: int) -> None:
    """Gemma 3's local layers keep a ring of window + one chunk on the device too; 300 tokens through a window
    of 5 wrap it, all layers on the device or half of them, and match the reference."""
    tiny = write_tiny_model(tmp_path / "gemma3.gguf", "gemma3", matrix_type=T.F32, n_ctx=512)
    model = load_model(tiny.path, n_ctx=512, device="numpy", gpu_layers=gpu_layers)
    assert [k.shape[1] for k in model.session().cache.device.k][:2] == [261, 261]
    ids = [int(i) for i in np.random.default_rng(1).integers(0, tiny.n_vocab - 2, 300)]
    ref = reference_logits(tiny, ids)
    close(model.logits(ids), ref, 0.002)
    session = model.session()
    session.eval(ids[:290])
    for i in range(290, 300):
        close(session.eval([ids[i]])[None], ref[i][None], 0.002)


def test_tied_output_on_the_device(tmp_path) -> None:
    tiny = write_tiny_model(tmp_path / "tied.gguf", "llama", tied=True)
    model = load_model(tiny.path, n_ctx=64, device="numpy")
    assert model.offload.output_w.name == "token_embd.weight"
    close(model.logits(IDS), reference_logits(tiny, IDS))


def test_gpu_layers_zero_and_bad_values(tmp_path) -> None:
    tiny = write_tiny_model(tmp_path / "m.gguf", "llama")
    model = load_model(tiny.path, n_ctx=64, device="numpy", gpu_layers=0)
    assert model.offload is None and model.device == "cpu"
    for bad in (-2, 1.5, "3", True):
        with pytest.raises(SettingsError, match="gpu layers must be -1"):
            load_model(tiny.path, n_ctx=64, device="numpy", gpu_layers=bad)
    with pytest.raises(SettingsError, match="device must be one of"):
        load_model(tiny.path, n_ctx=64, device="tpu")


# ---- the real models against the CPU engine -----------------------------------------------------------------


def sibling(model: Model, gpu_layers: int) -> Model:
    """The same file and weights as `model` in a new Model with the NumPy offload of `gpu_layers`."""
    offload = offload_for(model.cfg, model.weights, model.n_ctx, NUMPY, gpu_layers)
    return Model(
        model.file, model.cfg, model.weights, model.tokenizer, n_ctx=model.n_ctx, threads=model.threads, offload=offload
    )


def parity(cpu_logits: np.ndarray, dev_logits: np.ndarray) -> tuple[float, float, bool]:
    """(top-1 agreement, mean |Δ log-prob| of the CPU's top-1, every device top-1 within the CPU's top-5)."""
    lp_cpu, lp_dev = log_softmax(cpu_logits), log_softmax(dev_logits)
    n = len(lp_cpu)
    top1_cpu, top1_dev = lp_cpu.argmax(-1), lp_dev.argmax(-1)
    top5_cpu = np.argsort(-lp_cpu, axis=-1)[:, :5]
    within = all(top1_dev[i] in top5_cpu[i] for i in range(n))
    delta = float(np.abs(lp_cpu[np.arange(n), top1_cpu] - lp_dev[np.arange(n), top1_cpu]).mean())
    return float(np.mean(top1_cpu == top1_dev)), delta, within


@pytest.fixture(params=["smollm2", "qwen", "gemma3"])
def real(request):
    model, golden = {"smollm2": ("smollm2_model", "golden_smollm2"), "qwen": ("qwen_model", "golden_qwen"),
                     "gemma3": ("gemma3_model", "golden_gemma3")}[request.param]  # fmt: skip
    return request.getfixturevalue(model), request.getfixturevalue(golden)


def test_real_model_fully_offloaded_matches_cpu_engine(real) -> None:
    model, golden = real
    ids = golden["teacher"][0]["ids"]
    dev = sibling(model, -1)
    assert dev.offload.n_layers == model.cfg.n_layer and dev.offload.runs_output
    dev_logits = dev.logits(ids)  # (n, n_vocab)
    agreement, delta, within = parity(model.logits(ids), dev_logits)
    print(f"{model.name}: all layers + output: top-1 agreement {agreement:.3f}, mean |Δlp| {delta:.4f}")
    assert within, "a device top-1 outside the CPU engine's top-5"
    # Float products (device) against int8 ones (CPU): the CPU engine's own rounding noise, measured 0.018-0.022
    # (Qwen2.5) and 0.044-0.051 (SmolLM2) as the CPU side's norm and rope moved between NumPy and compiled code.
    # The exact check, with float products on both sides, is in the half-offload test below.
    assert delta <= 0.06, delta
    # Top-1 agreement with the CPU engine. Not measured here (no GPU on the machine where it was written): the rule
    # is to run this test with -s on the device, read the printed agreement for each model, and set the bound one
    # position below the lowest; until then it is held to the half-offload test's 0.9, which a device that
    # computed another model's logits (or the wrong layer's) fails by far.
    assert agreement >= 0.9, agreement
    ref_top5 = np.array(golden["teacher"][0]["top5_ids"])  # llama.cpp's, as test_golden checks the CPU engine
    assert all(t in ref_top5[i] for i, t in enumerate(dev_logits.argmax(-1)))


def test_real_model_half_offloaded_matches_cpu_engine(smollm2_model, golden_smollm2) -> None:
    """Half the layers on the device, the rest and the output head on the CPU: the activations cross over."""
    model = smollm2_model
    ids = golden_smollm2["teacher"][0]["ids"]
    dev = sibling(model, model.cfg.n_layer // 2)
    assert dev.offload.n_layers == model.cfg.n_layer // 2 and not dev.offload.runs_output
    agreement, delta, within = parity(model.logits(ids), dev.logits(ids))
    print(f"{model.name}: {dev.offload.n_layers} layers: top-1 agreement {agreement:.3f}, mean |Δlp| {delta:.4f}")
    # Half int8 products (CPU) and half float (device) sit between the two engines: measured 0.044-0.052 from
    # the all-int8 CPU engine, the CPU engine's own int8 rounding noise. The exact check is the one below.
    assert within and agreement >= 0.9 and delta <= 0.08, (agreement, delta)
    # With float products on the CPU too, the two halves compute the same numbers up to summation order.
    with float_products():
        agreement, delta, within = parity(model.logits(ids[:24]), dev.logits(ids[:24]))
    assert agreement == 1.0 and delta <= 1e-3, (agreement, delta)


def test_session_reuses_the_device_cache(smollm2_model, golden_smollm2) -> None:
    """Two turns through one session (the second reusing the first's device cache) equal one pass."""
    ids = golden_smollm2["teacher"][0]["ids"][:32]
    dev = sibling(smollm2_model, -1)
    whole = dev.session().eval(ids)  # (n_vocab,)
    session = dev.session()
    session.eval(ids[:20])
    assert session.n_past == 20
    split = session.eval(ids[20:])
    spread = whole.max() - whole.min()
    assert np.abs(split - whole).max() <= 1e-3 * spread
    assert int(split.argmax()) == int(whole.argmax())
    session.truncate(10)  # regenerate from position 10: later slots are overwritten
    again = session.eval(ids[10:])
    assert np.abs(again - whole).max() <= 1e-3 * spread
