"""Tiny synthetic GGUFs of every architecture against an independent float64 NumPy forward pass, through every
executor of the layer: the CPU prompt path, the CPU one-token step, the device (on NumPy)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine import ModelFileError, UnsupportedModelError, load_model

from .compare import REFERENCE_BOUNDS
from .compare import assert_matches_reference as close
from .synthetic import copy_metadata, reference_logits, rewrite_model, write_tiny_model

IDS = [3, 250, 17, 260, 99, 5, 42, 261, 7, 128, 64, 200, 1, 33]  # longer than the Gemma models' window of 5
ARCHES = ["llama", "llama3", "qwen2", "qwen3", "gemma2", "gemma3", "gpt2"]  # llama3: llama with rope_freqs


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("matrix_type", [T.Q8_0, T.F32, T.Q4_0, T.F16, T.BF16], ids=lambda t: t.name)
def test_forward_matches_reference(tmp_path, arch: str, matrix_type: T) -> None:
    tiny = write_tiny_model(tmp_path / f"{arch}.gguf", arch, matrix_type=matrix_type)
    model = load_model(tiny.path, n_ctx=64)
    ref = reference_logits(tiny, IDS)
    bound = REFERENCE_BOUNDS[matrix_type.name]  # int8-rounded activations or float products: see compare.py
    close(model.logits(IDS), ref, bound)
    session = model.session()  # incremental, in uneven chunks, through the KV cache
    for chunk in (IDS[:1], IDS[1:5], IDS[5:6], IDS[6:]):
        last = session.eval(chunk)
        close(last[None], ref[session.n_past - 1][None], bound)
    # Every executor of the one layer (engine/layer.py) against the same reference: the prompt path above; the
    # fused one-token step, token by token (F32 products have no one-token kernel: their tokens take the prompt
    # path); the device's ops with NumPy standing in for CuPy, every layer and the output head on it.
    assert (model._fast_layers() is not None) == (matrix_type != T.F32)
    one_token = model.session()
    close(np.stack([one_token.eval([i]) for i in IDS]), ref, bound)
    # The device's float products: measured up to 0.0013 of the spread (llama BF16; every family and type, whole
    # and token by token, Intel Xeon family 6 model 207, 2026-12-06), within the float products' bound.
    device = load_model(tiny.path, n_ctx=64, device="numpy")
    close(device.logits(IDS), ref, REFERENCE_BOUNDS["F32"])
    on_device = device.session()
    close(np.stack([on_device.eval([i]) for i in IDS]), ref, REFERENCE_BOUNDS["F32"])


def test_tied_output_uses_token_embedding(tmp_path) -> None:
    tiny = write_tiny_model(tmp_path / "tied.gguf", "llama", tied=True)
    model = load_model(tiny.path, n_ctx=64)
    assert model.weights.output is model.weights.token_embd
    close(model.logits(IDS), reference_logits(tiny, IDS))


def test_missing_tensor_is_named(tmp_path) -> None:
    tiny = write_tiny_model(tmp_path / "m.gguf", "qwen2", drop=("blk.1.attn_k.bias",))
    with pytest.raises(ModelFileError, match=r"blk\.1\.attn_k\.bias: missing"):
        load_model(tiny.path)


def test_wrong_shape_is_named(tmp_path) -> None:
    tiny = write_tiny_model(tmp_path / "ok.gguf", "llama", matrix_type=T.F32)
    path = tmp_path / "shape.gguf"
    rewrite_model(tiny.path, path, lambda name, data: data[:32] if name == "blk.0.attn_q.weight" else data)
    with pytest.raises(ModelFileError, match=r"tensor blk\.0\.attn_q\.weight: expected 64×64, file has 64×32"):
        load_model(path)


def test_unsupported_tensor_type_is_named(tmp_path) -> None:
    tiny = write_tiny_model(tmp_path / "ok.gguf", "llama", matrix_type=T.F32)
    path = tmp_path / "f64.gguf"
    widen = "blk.1.ffn_up.weight"
    rewrite_model(tiny.path, path, lambda name, data: data.astype(np.float64) if name == widen else data)
    with pytest.raises(UnsupportedModelError, match=r"tensor blk\.1\.ffn_up\.weight: type F64 is not supported"):
        load_model(path)


def test_unknown_architecture(tmp_path) -> None:
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' is not supported"):
        load_model(path)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_window_ring_over_a_long_text(tmp_path, arch: str) -> None:
    """300 tokens through a window of 5: the local layers' ring cache (window + one prompt chunk = 261 rows)
    wraps, in the prompt path's chunks of 256 and then token by token, and still matches the reference."""
    tiny = write_tiny_model(tmp_path / f"{arch}.gguf", arch, matrix_type=T.F32, n_ctx=512)
    model = load_model(tiny.path, n_ctx=512)
    assert [k.shape[1] for k in model.session().cache.k][:2] == [261, 512 if arch == "gemma2" else 261]
    ids = [int(i) for i in np.random.default_rng(1).integers(0, tiny.n_vocab - 2, 300)]
    ref = reference_logits(tiny, ids)
    close(model.logits(ids), ref, REFERENCE_BOUNDS["F32"])
    session = model.session()
    session.eval(ids[:270])
    for i in range(270, 300):
        close(session.eval([ids[i]])[None], ref[i][None], REFERENCE_BOUNDS["F32"])


def test_truncate_past_the_ring_replays_the_kept_tokens(tmp_path) -> None:
    """Going back further than a ring remembers (a regenerate after a long reply) re-evaluates what is kept:
    the next logits equal a fresh evaluation's."""
    tiny = write_tiny_model(tmp_path / "gemma3.gguf", "gemma3", matrix_type=T.F32, n_ctx=512)
    model = load_model(tiny.path, n_ctx=512)
    ids = [int(i) for i in np.random.default_rng(2).integers(0, tiny.n_vocab - 2, 400)]
    session = model.session()
    session.eval(ids)
    session.truncate(20)  # positions 16..19 were overwritten by 277..280
    assert session.tokens == ids[:20]
    again = session.eval([ids[20]])
    close(again[None], reference_logits(tiny, ids[:21])[-1][None], REFERENCE_BOUNDS["F32"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rope.scaling.type": "longrope"}, "rope.scaling.type: 'longrope' rope scaling is not supported"),
        (
            {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_log_multiplier": 0.1},
            "yarn_log_multiplier: 0.1.* is not supported",
        ),
        ({"expert_count": 8}, "mixture of experts"),
    ],
)
def test_unimplemented_features_are_named(tmp_path, extra: dict, message: str) -> None:
    tiny = write_tiny_model(tmp_path / "m.gguf", "qwen3", matrix_type=T.F32, extra=extra)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(tiny.path)


def test_mixture_of_experts_tensors_are_named(tmp_path) -> None:
    tiny = write_tiny_model(tmp_path / "ok.gguf", "llama", matrix_type=T.F32)
    path = tmp_path / "moe.gguf"
    import gguf

    reader = gguf.GGUFReader(tiny.path)
    writer = gguf.GGUFWriter(str(path), "llama")
    copy_metadata(reader, writer)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 128, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_gate_exps\.weight: mixture-of-experts"):
        load_model(path)


def test_cli_refuses_an_unimplemented_feature_in_one_line(tmp_path) -> None:
    """`chatapp run` on a file that needs LongRoPE: one line naming it, exit 2, no traceback."""
    import subprocess
    import sys

    extra = {"rope.scaling.type": "longrope"}
    tiny = write_tiny_model(tmp_path / "longrope.gguf", "qwen3", matrix_type=T.F32, extra=extra)
    run = [sys.executable, "-m", "chatapp", "run", "-m", str(tiny.path), "-p", "hi", "-n", "1"]
    result = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1] == "chatapp: error: metadata qwen3.rope.scaling.type: 'longrope' rope scaling is not supported"


LLAMA_CPP = Path(__file__).resolve().parents[1] / "golden" / "synthetic-llama-cpp.npz"


@pytest.fixture(scope="module")
def llama_cpp_logits() -> dict:
    """llama.cpp's logits on the synthetic models (benchmarks/llama_cpp_synthetic.py wrote them)."""
    assert LLAMA_CPP.is_file(), f"{LLAMA_CPP} is missing: run benchmarks/llama_cpp_synthetic.py"
    with np.load(LLAMA_CPP) as data:
        return {key: data[key] for key in data.files}


@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma2", "gemma3"])
@pytest.mark.parametrize("matrix_type", [T.F32, T.Q8_0], ids=lambda t: t.name)
def test_synthetic_models_match_llama_cpp(tmp_path, llama_cpp_logits: dict, family: str, matrix_type: T) -> None:
    """Each family's tiny model against llama.cpp's own logits, 20 tokens (4 times the Gemma window), fresh and
    token by token. Measured max |Δ| / spread: F32 1.6-3.5e-4, Q8_0 0.009-0.015 (AVX-512); the float64 reference
    and llama.cpp agree to 2.8-6.9e-4 on F32, so the bounds are the reference bounds."""
    name = f"{family}-{matrix_type.name}"
    tiny = write_tiny_model(tmp_path / f"{name}.gguf", family, matrix_type=matrix_type)
    assert hashlib.sha256(tiny.path.read_bytes()).hexdigest() == str(llama_cpp_logits[f"sha256/{name}"])
    ids = [int(i) for i in llama_cpp_logits["ids"]]
    want = llama_cpp_logits[f"logits/{name}"]  # (20, n_vocab)
    model = load_model(tiny.path, n_ctx=64)
    bound = REFERENCE_BOUNDS[matrix_type.name]
    close(model.logits(ids), want, bound)
    session = model.session()
    close(np.stack([session.eval([i]) for i in ids]), want, bound)


LLAMA_CPP_MXFP4 = LLAMA_CPP.with_name("synthetic-mxfp4-llama-cpp.npz")


def test_mxfp4_model_matches_llama_cpp(tmp_path) -> None:
    """llama3's tiny model with MXFP4 matrices (gpt-oss's expert format, through ggml's own kernels in
    llama.cpp), against llama.cpp's logits on the same file and the float64 reference: the prompt path, the
    one-token kernels, the device. Measured max |Δ| / spread per position (Intel Xeon family 6 model 207,
    AVX-512 VNNI): 0.017 from llama.cpp, 0.030 from the reference (llama.cpp itself 0.026), the device's float
    products 0.0009 from the reference; the same weights unquantized are 0.57 from llama.cpp's logits, so the
    int8 bound holds the decoding to account."""
    with np.load(LLAMA_CPP_MXFP4) as data:
        golden = {key: data[key] for key in data.files}
    tiny = write_tiny_model(tmp_path / "llama3-MXFP4.gguf", "llama3", matrix_type=T.MXFP4)
    assert hashlib.sha256(tiny.path.read_bytes()).hexdigest() == str(golden["sha256/llama3-MXFP4"])
    ids = [int(i) for i in golden["ids"]]
    want = golden["logits/llama3-MXFP4"]  # (20, n_vocab)
    ref = reference_logits(tiny, ids)
    bound = REFERENCE_BOUNDS["MXFP4"]
    model = load_model(tiny.path, n_ctx=64)
    ours = model.logits(ids)
    close(ours, want, bound)
    close(ours, ref, bound)
    assert model._fast_layers() is not None  # token by token through the fused one-token kernel
    session = model.session()
    close(np.stack([session.eval([i]) for i in ids]), want, bound)
    device = load_model(tiny.path, n_ctx=64, device="numpy")
    close(device.logits(ids), ref, REFERENCE_BOUNDS["F32"])


# qwen3moe's tiny model with MXFP4 matrices, experts included: router margins (the reference's gaps) 0.011 to 0.81.
# int8 activations chose another expert at the engine's position 1 (margin 0.013; 0.21 of the spread away) and at
# llama.cpp's position 8 (margin 0.027), as with Q8_0 files (test_moe_families.py). Positions under these margins
# are left out: against llama.cpp (7 of 20), against the reference (2 of 20).
MXFP4_NEAR_TIE = 0.1
MXFP4_REFERENCE_NEAR_TIE = 0.02


def test_mxfp4_experts_match_llama_cpp(tmp_path) -> None:
    """The router FFN over MXFP4 experts (each a view of the 3-D tensor's 17-byte-block rows, packed when first
    chosen), against llama.cpp and the float64 reference, the prompt path and token by token; the device's
    decoder over the chosen experts' slices at every position. Measured max |Δ| / spread (Intel Xeon family 6
    model 207, AVX-512 VNNI) where no near-tie: 0.009 from llama.cpp, 0.012 from the reference; the device
    0.0003."""
    with np.load(LLAMA_CPP_MXFP4) as data:
        golden = {key: data[key] for key in data.files}
    tiny = write_tiny_model(tmp_path / "qwen3moe-MXFP4.gguf", "qwen3moe", matrix_type=T.MXFP4)
    assert hashlib.sha256(tiny.path.read_bytes()).hexdigest() == str(golden["sha256/qwen3moe-MXFP4"])
    ids = [int(i) for i in golden["ids"]]
    want = golden["logits/qwen3moe-MXFP4"]  # (20, n_vocab)
    gaps = np.zeros(len(ids))
    ref = reference_logits(tiny, ids, gaps)
    clear, held = gaps >= MXFP4_NEAR_TIE, gaps >= MXFP4_REFERENCE_NEAR_TIE
    assert clear.sum() >= 12 and held.sum() >= 18, np.round(gaps, 3)
    bound = REFERENCE_BOUNDS["MXFP4"]
    model = load_model(tiny.path, n_ctx=64)
    session = model.session()
    for ours in (model.logits(ids), np.stack([session.eval([i]) for i in ids])):
        close(ours[clear], want[clear], bound)
        close(ours[held], ref[held], bound)
    device = load_model(tiny.path, n_ctx=64, device="numpy")
    close(device.logits(ids), ref, REFERENCE_BOUNDS["F32"])


@pytest.mark.parametrize("matrix_type", [T.F32, T.Q8_0], ids=lambda t: t.name)
def test_yarn_matches_llama_cpp(tmp_path, llama_cpp_logits: dict, matrix_type: T) -> None:
    """Qwen3 with YaRN (factor 4 over an original context of 16, attention factor 0.9) over 40 positions, against
    llama.cpp's logits and the float64 reference, fresh and token by token. Measured max |Δ| / spread against
    llama.cpp: F32 4.6e-4, Q8_0 0.017; against the reference F32 6.8e-4, Q8_0 0.022 (llama.cpp itself: 7.0e-4,
    0.023); the same weights without the scaling are 0.57 away, so the reference bounds hold it."""
    name = f"qwen3-yarn-{matrix_type.name}"
    tiny = write_tiny_model(tmp_path / f"{name}.gguf", "qwen3", matrix_type=matrix_type, yarn=(4.0, 16, 0.9))
    assert hashlib.sha256(tiny.path.read_bytes()).hexdigest() == str(llama_cpp_logits[f"sha256/{name}"])
    ids = [int(i) for i in llama_cpp_logits["yarn_ids"]]
    assert len(ids) > 16  # past the original context
    want = llama_cpp_logits[f"logits/{name}"]  # (40, n_vocab)
    model = load_model(tiny.path, n_ctx=64)
    bound = REFERENCE_BOUNDS[matrix_type.name]
    ours = model.logits(ids)
    close(ours, want, bound)
    close(ours, reference_logits(tiny, ids), bound)
    session = model.session()
    close(np.stack([session.eval([i]) for i in ids]), want, bound)


@pytest.mark.parametrize(
    ("arch", "fault"),
    [
        ("gemma3", {"sliding_window": 6}),  # one key too many in the window
        ("gemma3", {"local": (False,) * 6}),  # every layer global
        ("gemma3", {"rope_base_local": 1e6}),  # local layers on the global base
        ("gemma3", {"embed_scale": 1.0}),
        ("gemma2", {"attn_softcap": 0.0}),
        ("gemma2", {"final_softcap": 0.0}),
        ("qwen3", {"attn_scale": 1 / 4.0}),  # 1/√(d/n_head) instead of 1/√key_length
    ],
    ids=lambda v: v if isinstance(v, str) else next(iter(v)),
)
def test_each_family_constant_is_checked(tmp_path, arch: str, fault: dict) -> None:
    """Each resolved constant, set wrong on a loaded model, fails the reference comparison over IDS (longer
    than the window): the synthetic tests would catch a family described wrongly."""
    from dataclasses import replace

    from engine.layer import rope_tables

    tiny = write_tiny_model(tmp_path / f"{arch}.gguf", arch, matrix_type=T.F32)
    model = load_model(tiny.path, n_ctx=64)
    ref = reference_logits(tiny, IDS)
    close(model.logits(IDS), ref, REFERENCE_BOUNDS["F32"])
    model.cfg = replace(model.cfg, **fault)
    local = rope_tables(model.cfg, 64, None, local=True)
    model._rope = [local if is_local else r for is_local, r in zip(model.cfg.local, model._rope, strict=True)]
    with pytest.raises(AssertionError):
        close(model.logits(IDS), ref, REFERENCE_BOUNDS["F32"])


def test_context_shift_and_cache_reuse_with_rings(tmp_path) -> None:
    """A Gemma 3 chat in a 320-token context (rings of 261 rows): every turn reuses the cache and, once the
    context is full, shifts it; after each turn the cache's next logits equal a fresh evaluation's (exact mode)."""
    from engine.chat import ChatSession
    from engine.events import Message, TurnStats
    from engine.kernels import float_products
    from engine.sampling import SamplingSettings

    from .compare import assert_cache_exactly_fresh

    tiny = write_tiny_model(tmp_path / "gemma3.gguf", "gemma3", matrix_type=T.F32, n_ctx=512)
    chat = ChatSession(load_model(tiny.path, n_ctx=320), SamplingSettings(temperature=0.0, max_tokens=120))
    assert chat.session.cache.ring_rows == 261
    messages, shifts = [], 0
    with float_products():
        for turn in range(4):
            messages.append(Message("user", f"turn {turn}: tell me about the sea and the sky and the hills " * 2))
            stats = [e for e in chat.stream_reply(messages) if isinstance(e, TurnStats)][-1]
            messages.append(Message("assistant", stats.reply))
            shifts += stats.context_shifts
            assert_cache_exactly_fresh(chat)
    assert shifts >= 3
