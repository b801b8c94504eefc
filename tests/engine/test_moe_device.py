"""The mixture-of-experts families on a device (engine/gpu/offload.py DeviceOps.router_ffn), run on the NumPy
backend: each family's synthetic file fully and partly offloaded, against the float64 reference and against the
CPU engine; the experts uploaded in their encoding and dequantized only where chosen, once per pass."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import engine.gpu.offload
from engine import load_model
from engine.gpu.matrix import DeviceExperts, DeviceMatrix
from engine.kernels import float_products
from engine.moe import RouterFfn
from tests.engine.compare import FLOAT_REFERENCE_BOUND, assert_matches_reference
from tests.engine.synthetic import TinyModel, reference_logits, write_tiny_model

FAMILIES = ["qwen3moe", "olmoe", "qwen2moe", "granitemoe", "granitemoeshared"]
IDS = [3, 250, 17, 260, 99, 5, 42, 261, 7, 128, 64, 200, 1, 33, 77, 150, 9, 211, 45, 120]  # llama.cpp's golden ids
# The device against the CPU engine, both in float products (the CPU under float_products(): the device has no
# other), all layers or the first only: max |Δ| / spread measured 1.0e-7 (granitemoe) to 2.3e-5 (qwen3moe F32),
# Q8_0 and F32, on an Intel Xeon (family 6 model 207, AVX-512, 2 threads; 2026-12-06). Summation order only: one
# token routed to another expert, or the wrong weights, moves the logits by 1e-2 and more. Bound 4x the largest.
DEVICE_CPU_BOUND = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[tuple[str, T], tuple[TinyModel, np.ndarray]]:
    """Each family's synthetic file (seed 0, as test_moe*.py write them), F32 and Q8_0, with its reference logits."""
    d = tmp_path_factory.mktemp("moe-device")
    out = {}
    for arch in FAMILIES:
        for t in (T.F32, T.Q8_0):
            m = write_tiny_model(d / f"{arch}-{t.name}.gguf", arch, matrix_type=t)
            out[arch, t] = m, reference_logits(m, IDS)
    return out


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("matrix_type", [T.F32, T.Q8_0], ids=lambda t: t.name)
def test_offloaded_matches_reference_and_cpu(tiny, arch: str, matrix_type: T) -> None:
    """All layers and the output on the device, then the first layer only (the rest on the CPU): the prompt
    whole and token by token (the device's one-token path), against the reference at the float bound: the
    device's products are float ones, Q8_0 weights dequantized. Measured max |Δ| / spread, all layers: 2.0e-5
    (granitemoeshared) to 6.8e-4 (qwen2moe F32), Q8_0 at most 1.1e-3 (qwen2moe)."""
    m, ref = tiny[arch, matrix_type]
    cpu = load_model(m.path, n_ctx=64)
    with float_products():
        cpu_logits = cpu.logits(IDS)
    for gpu_layers in (-1, 1):
        model = load_model(m.path, n_ctx=64, device="numpy", gpu_layers=gpu_layers)
        assert model.offload is not None and model.offload.n_layers == (m.n_layer if gpu_layers == -1 else 1)
        assert not model.warnings
        # The first layer only: the CPU's layers with int8 activations may choose other experts at router
        # near-ties (granitemoeshared's position 12, margin 0.004), so the whole model runs float products.
        with float_products():
            whole = model.logits(IDS)  # (20, n_vocab)
            session = model.session()
            one_by_one = np.stack([session.eval([i]) for i in IDS])
        for ours in (whole, one_by_one):
            assert_matches_reference(ours, ref, FLOAT_REFERENCE_BOUND)
        delta = np.abs(whole - cpu_logits).max() / (cpu_logits.max() - cpu_logits.min())
        assert delta <= DEVICE_CPU_BOUND, f"device against the CPU engine: {delta:.2e} of the spread"


def test_experts_stay_encoded_and_only_the_chosen_are_dequantized(tiny, monkeypatch) -> None:
    """The 3-D expert tensors go to the device in the file's Q8_0 bytes; a pass of 20 tokens dequantizes, per layer,
    the slice of each expert some token chose, once per matrix, and no other."""
    m, _ = tiny["qwen3moe", T.Q8_0]
    model = load_model(m.path, n_ctx=64, device="numpy")
    ffn = model.offload.layers[1].ffn
    assert isinstance(ffn, RouterFfn) and isinstance(ffn.up, DeviceExperts)
    assert ffn.up.raw.dtype == np.uint8 and ffn.up.raw.shape == (8, 64, 64 // 32 * 34)  # (n_expert, rows, Q8_0 row)
    assert ffn.up.nbytes == model.file.tensors["blk.1.ffn_up_exps.weight"].data.nbytes
    experts = sum(
        model.file.tensors[f"blk.{i}.ffn_{k}_exps.weight"].data.nbytes for i in (0, 1) for k in "gate up down".split()
    )
    assert model.offload.nbytes > experts  # the device memory counted holds every expert

    dequantized: list[str] = []
    chosen: list[np.ndarray] = []  # per layer, the experts each token chose (t, k)
    real_dequantize, real_route = DeviceMatrix.dequantize, engine.gpu.offload.route

    def dequantize(self, xp, r0=0, r1=None):
        dequantized.append(self.name)
        return real_dequantize(self, xp, r0, r1)

    def route(logits, k, norm_weights):
        ids, w = real_route(logits, k, norm_weights)
        chosen.append(ids)
        return ids, w

    monkeypatch.setattr(DeviceMatrix, "dequantize", dequantize)
    monkeypatch.setattr(engine.gpu.offload, "route", route)
    model.logits(IDS)
    assert len(chosen) == m.n_layer
    expected = [
        f"blk.{layer}.ffn_{k}_exps.weight[{e}]"
        for layer, ids in enumerate(chosen)
        for e in np.unique(ids).tolist()
        for k in ("gate", "up", "down")
    ]
    assert 2 < len(np.unique(chosen[0])) < 8  # the pass spreads over several experts, not all of them
    assert sorted(n for n in dequantized if "_exps" in n) == sorted(expected)
