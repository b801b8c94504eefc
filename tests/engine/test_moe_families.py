"""The mixture-of-experts families built from qwen3moe's parts (engine/moe.py), each a row of engine/families.py
plus its own operations: the synthetic file of each, held to llama.cpp's logits on it and to the float64
reference (tests/engine/synthetic.py), on the prompt path and token by token. `granitemoeshared` is a granitemoe
file with Granite's shared expert (HF's granitemoeshared, llama.cpp's granitemoe with n_ff_shexp > 0). The same
files on a device: tests/engine/test_moe_device.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine import UnsupportedModelError, load_model
from engine.config import ModelConfig
from engine.gguf_file import open_gguf
from engine.moe import RouterFfn
from tests.engine.compare import FLOAT_REFERENCE_BOUND, REFERENCE_BOUNDS, assert_matches_reference
from tests.engine.synthetic import TinyModel, reference_logits, write_tiny_model

FAMILIES = ["olmoe", "qwen2moe", "granitemoe", "granitemoeshared"]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "synthetic-moe-llama-cpp.npz"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[tuple[str, T], TinyModel]:
    """Each family's synthetic model, seed 0, F32 and Q8_0 (as benchmarks/llama_cpp_synthetic.py writes them)."""
    d = tmp_path_factory.mktemp("moe-families")
    return {
        (arch, t): write_tiny_model(d / f"{arch}-{t.name}.gguf", arch, matrix_type=t)
        for arch in FAMILIES
        for t in (T.F32, T.Q8_0)
    }


@pytest.fixture(scope="module")
def llama_cpp() -> dict:
    assert GOLDEN.is_file(), f"{GOLDEN} is missing: run benchmarks/llama_cpp_synthetic.py (see its docstring)"
    with np.load(GOLDEN) as data:
        return {key: data[key] for key in data.files}


def _config(m: TinyModel) -> ModelConfig:
    f = open_gguf(m.path)
    return ModelConfig.from_metadata(f.metadata, m.n_vocab)


def test_olmoe_reads_its_description(tiny) -> None:
    cfg = _config(tiny["olmoe", T.Q8_0])
    assert cfg.spec.moe and not cfg.spec.moe_norm_weights and cfg.spec.rope_neox
    assert cfg.spec.qk_norm and cfg.spec.qk_norm_rows
    assert (cfg.n_expert, cfg.n_expert_used, cfg.d_ff_exp) == (8, 2, 64)  # the width from feed_forward_length
    expected = cfg.expected_tensors()
    assert expected["blk.0.attn_q_norm.weight"] == ((64,), True)  # n_head·head_dim (4·16), not head_dim
    assert expected["blk.0.attn_k_norm.weight"] == ((64,), True)


def test_qwen2moe_reads_its_description(tiny) -> None:
    cfg = _config(tiny["qwen2moe", T.Q8_0])
    assert cfg.spec.moe and cfg.spec.shared_expert and not cfg.spec.moe_norm_weights and cfg.spec.qkv_bias
    assert (cfg.n_expert, cfg.n_expert_used, cfg.d_ff_exp, cfg.d_ff_shexp) == (8, 2, 64, 96)
    expected = cfg.expected_tensors()
    assert expected["blk.1.ffn_gate_inp_shexp.weight"] == ((64,), True)
    assert expected["blk.1.ffn_down_shexp.weight"] == ((96, 64), True)  # ggml order: (d_ff_shexp, d)
    olmoe = _config(tiny["olmoe", T.Q8_0]).expected_tensors()
    assert not any("shexp" in name for name in olmoe)


def test_granitemoe_reads_its_scales(tiny) -> None:
    cfg = _config(tiny["granitemoe", T.Q8_0])
    assert cfg.spec.moe and cfg.spec.moe_norm_weights and not cfg.spec.rope_neox
    assert (cfg.n_expert, cfg.n_expert_used, cfg.d_ff_exp, cfg.d_ff_shexp) == (8, 2, 64, 0)  # no shared expert
    assert not any("shexp" in name for name in cfg.expected_tensors())
    assert (cfg.embed_scale, cfg.attn_scale, cfg.logit_scale) == (12.0, 0.015625, 0.5)
    assert cfg.residual_scale == pytest.approx(0.22)


def test_granitemoe_takes_a_shared_expert_where_the_file_gives_one(tiny) -> None:
    """Granite's shared expert (the file's expert_shared_feed_forward_length): gate, up and down, no sigmoid gate."""
    m = tiny["granitemoeshared", T.Q8_0]
    cfg = _config(m)
    assert cfg.arch == "granitemoe" and cfg.spec.shared_expert == "plain"
    assert (cfg.n_expert, cfg.n_expert_used, cfg.d_ff_exp, cfg.d_ff_shexp) == (8, 2, 64, 96)
    expected = cfg.expected_tensors()
    assert expected["blk.1.ffn_up_shexp.weight"] == ((64, 96), True)
    assert expected["blk.1.ffn_down_shexp.weight"] == ((96, 64), True)
    assert "blk.1.ffn_gate_inp_shexp.weight" not in expected
    gate, up, down, gate_inp = RouterFfn.bind(open_gguf(m.path), cfg, 1).shared or (None,) * 4
    assert gate is not None and (up.rows, up.cols, down.rows, down.cols) == (96, 64, 64, 96) and gate_inp is None


def test_granitemoe_without_the_width_refuses_shared_expert_tensors(tiny, tmp_path) -> None:
    """The same tensors in a file that does not give expert_shared_feed_forward_length: refused by name, as
    llama.cpp would not load them either, rather than run without them."""
    reader = gguf.GGUFReader(tiny["granitemoeshared", T.Q8_0].path)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "granitemoe")
    for f in reader.fields.values():
        if not f.name.startswith("GGUF.") and f.name not in (
            "general.architecture",
            "granitemoe.expert_shared_feed_forward_length",
        ):
            writer.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"^tensor blk\.0\.ffn_\w+_shexp\.weight: shared-expert tensors"):
        load_model(tmp_path / "m.gguf", n_ctx=64)


@pytest.mark.parametrize("arch", FAMILIES)
def test_synthetic_file_is_the_one_llama_cpp_ran(tiny, llama_cpp: dict, arch: str) -> None:
    for t in (T.F32, T.Q8_0):
        assert hashlib.sha256(tiny[arch, t].path.read_bytes()).hexdigest() == str(llama_cpp[f"sha256/{arch}-{t.name}"])


@pytest.mark.parametrize("arch", FAMILIES)
def test_reference_matches_llama_cpp_on_the_f32_file(tiny, llama_cpp: dict, arch: str) -> None:
    """The float64 reference is llama.cpp's forward pass for the family: max |Δ| / spread measured (AVX-512) olmoe
    4.8e-4, qwen2moe 6.3e-4, granitemoe 3.8e-5, granitemoeshared 2.6e-5, within the float bound (without the
    shared expert in the reference, granitemoeshared's is far outside it)."""
    ids = [int(i) for i in llama_cpp["ids"]]
    ref = reference_logits(tiny[arch, T.F32], ids)
    assert_matches_reference(llama_cpp[f"logits/{arch}-F32"], ref, FLOAT_REFERENCE_BOUND)


# Router margin under which llama.cpp's Q8_0 pass may choose another expert than the float64 reference: its int8
# activations flipped olmoe's position 8, margin 0.062 in layer 1 (0.20 of the spread there). Positions with a
# margin under 0.1 in some layer (olmoe 6 of 20, 0.018 to 0.088; qwen2moe 8, 0.016 to 0.089, none flipped) are
# left out of the comparison with llama.cpp's Q8_0 logits, not with the reference; at least 12 are kept.
NEAR_TIE = 0.1
# Router margin under which the engine's int8 activations may choose another expert than the float64 reference, as
# llama.cpp's do: granitemoeshared's position 12, margin 0.004, flipped in both (0.079 of the spread from the
# reference, 0.005 from llama.cpp); margins of 0.007-0.008 elsewhere did not. Such positions of the Q8_0 files are
# left out of the comparison with the reference (none of olmoe's or qwen2moe's, whose margins are 0.016 or more).
REFERENCE_NEAR_TIE = 0.005


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("matrix_type", [T.F32, T.Q8_0], ids=lambda t: t.name)
def test_matches_llama_cpp_and_the_reference(tiny, llama_cpp: dict, arch: str, matrix_type: T) -> None:
    """The whole model, the prompt path and token by token, against the float64 reference and llama.cpp's logits
    on the same file (20 tokens), at the reference bounds. Measured max |Δ| / spread (AVX-512), against llama.cpp
    and the reference: olmoe F32 2.8e-4, 4.3e-4; Q8_0 0.012 (where no router near-tie, NEAR_TIE, lets int8
    rounding choose another expert; the F32 files have no exception), 0.013; qwen2moe F32 3.2e-4, 6.8e-4; Q8_0
    0.014 (at every position), 0.034; granitemoe F32 2.5e-5, 2.6e-5; Q8_0 0.0033, 0.0034; granitemoeshared F32
    2.0e-5, 2.1e-5; Q8_0 0.0051 (at every position), 0.0050 (where no REFERENCE_NEAR_TIE)."""
    ids = [int(i) for i in llama_cpp["ids"]]
    want = llama_cpp[f"logits/{arch}-{matrix_type.name}"]  # (20, n_vocab)
    gaps = np.zeros(len(ids))
    ref = reference_logits(tiny[arch, matrix_type], ids, gaps)
    model = load_model(tiny[arch, matrix_type].path, n_ctx=64)
    bound = REFERENCE_BOUNDS[matrix_type.name]
    clear = gaps >= NEAR_TIE if matrix_type == T.Q8_0 else np.ones(len(ids), dtype=bool)
    assert clear.sum() >= 12, f"{arch}: {np.flatnonzero(~clear)} are router near-ties"
    held = gaps >= REFERENCE_NEAR_TIE if matrix_type == T.Q8_0 else np.ones(len(ids), dtype=bool)
    assert held.sum() >= 19, f"{arch}: {np.flatnonzero(~held)} are router near-ties"
    whole = model.logits(ids)
    session = model.session()
    one_by_one = np.stack([session.eval([i]) for i in ids])
    for ours in (whole, one_by_one):
        assert_matches_reference(ours[held], ref[held], bound)
        assert_matches_reference(ours[clear], want[clear], bound)
