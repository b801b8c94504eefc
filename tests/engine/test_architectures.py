"""Tiny synthetic GGUFs of every architecture against an independent float64 NumPy forward pass."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine import ModelFileError, UnsupportedModelError, load_model

from .compare import REFERENCE_BOUNDS
from .compare import assert_matches_reference as close
from .synthetic import reference_logits, rewrite_model, write_tiny_model

IDS = [3, 250, 17, 260, 99, 5, 42, 261, 7, 128, 64, 200, 1, 33]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
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
