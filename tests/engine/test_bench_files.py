"""The random-weight benchmark files of benchmarks/make_gguf.py: well-formed blocks that gguf-py decodes to finite,
modest weights; llama.cpp's Q4_K_M type mix; and both engines load the file and agree on its logits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from benchmarks.make_gguf import PRESETS, plan, tensor_chunks, write_model
from engine import load_model
from tests.app.llama_cpp_server import ensure_server_python

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun."

# llama.cpp's logits of every position, in its own venv (llama-cpp-python is never a dependency of ours).
_LLAMA = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
ids = json.loads(sys.argv[2])
llm = Llama(model_path=sys.argv[1], n_ctx=128, n_batch=128, n_threads=2, logits_all=True, verbose=False)
llm.eval(ids)
print(json.dumps(np.array(llm.scores[: len(ids)], dtype=np.float32).tolist()))
"""


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """The tiny preset, Q4_K_M mix, SmolLM2's vocabulary (49152 rows of embedding and head)."""
    path = tmp_path_factory.mktemp("bench-file") / "tiny.gguf"
    write_model(path, PRESETS["tiny"], "q4_k_m", seed=0, vocab_from=smollm2_path)
    return path


@pytest.fixture(scope="module")
def tiny_moe_file(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """The tiny-moe preset (qwen3moe: 16 experts, 4 used; heads of 128 with q/k norms), Q4_K_M mix."""
    path = tmp_path_factory.mktemp("bench-file") / "tiny-moe.gguf"
    write_model(path, PRESETS["tiny-moe"], "q4_k_m", seed=0, vocab_from=smollm2_path)
    return path


@pytest.fixture(scope="module")
def tiny_reader(tiny_file: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(tiny_file)  # parsing 98k vocabulary strings takes seconds: once per module


def test_blocks_decode_to_finite_modest_weights(tiny_reader: gguf.GGUFReader) -> None:
    """Every matrix's first rows, decoded by gguf-py: finite, centred, spread ~1/sqrt(n_in), normal float16
    scales; norms are ones; the types and shapes are the plan's."""
    tensors = {t.name: t for t in tiny_reader.tensors}
    expected = plan(PRESETS["tiny"], "q4_k_m", 49152)
    assert list(tensors) == [name for name, _, _ in expected]
    for name, ggml_type, byte_shape in expected:
        t = tensors[name]
        assert t.tensor_type == ggml_type, name
        if ggml_type == T.F32:
            assert np.array_equal(t.data, np.ones(byte_shape, np.float32)), name
            continue
        assert t.data.shape == byte_shape, name
        w = gguf.quants.dequantize(t.data[:16], ggml_type)  # (16, n_in) float32
        sigma = 1.0 / np.sqrt(w.shape[1])
        assert np.isfinite(w).all(), name
        assert 0.6 * sigma < w.std() < 1.4 * sigma, f"{name}: sd {w.std():.4f}, aimed at {sigma:.4f}"
        assert abs(w.mean()) < 0.1 * sigma, f"{name}: mean {w.mean():.5f}"
        assert np.abs(w).max() < 4 * sigma, name
        blocks = t.data[:16].reshape(-1, 144 if ggml_type == T.Q4_K else 210)  # (n_blocks, block bytes)
        d = blocks[:, :2] if ggml_type == T.Q4_K else blocks[:, 208:]
        d = np.ascontiguousarray(d).view(np.float16).astype(np.float32)
        assert (d >= np.finfo(np.float16).smallest_normal).all(), f"{name}: subnormal float16 scale"


def test_q4_k_m_mix_and_vocabulary(tiny_reader: gguf.GGUFReader, smollm2_path: Path) -> None:
    """Q6_K on the head and on half the attn_v and ffn_down of the 8B shape (llama.cpp's layers); the
    tokenizer and chat template are SmolLM2's, byte for byte."""
    types = {name: t for name, t, _ in plan(PRESETS["llama-8b"], "q4_k_m", 49152)}
    six = {n for n, t in types.items() if t == T.Q6_K}
    assert "output.weight" in six and "token_embd.weight" not in six
    assert sum(n.endswith("attn_v.weight") for n in six) == sum(n.endswith("ffn_down.weight") for n in six) == 16
    assert {"blk.0.attn_v.weight", "blk.6.ffn_down.weight", "blk.31.attn_v.weight"} <= six
    assert not six & {"blk.4.attn_v.weight", "blk.5.ffn_down.weight", "blk.0.attn_q.weight"}

    ours, theirs = tiny_reader.fields, gguf.GGUFReader(smollm2_path).fields
    borrowed = [k for k in theirs if k.startswith("tokenizer.")]
    assert "tokenizer.chat_template" in borrowed and "tokenizer.ggml.merges" in borrowed
    for key in borrowed:  # the fields' bytes: type, length, every item
        assert b"".join(p.tobytes() for p in ours[key].parts) == b"".join(p.tobytes() for p in theirs[key].parts), key
    assert ours["llama.vocab_size"].contents() == len(theirs["tokenizer.ggml.tokens"].data)


def test_seeded_and_streamed() -> None:
    """One seed, one byte stream, whatever the chunk size (whole blocks); another seed, other bytes."""

    def tensor(seed: int, chunk_bytes: int) -> bytes:
        rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed)))
        return b"".join(c.tobytes() for c in tensor_chunks(T.Q4_K, 40, 512, rng, chunk_bytes))

    whole = tensor(0, 1 << 20)
    assert len(whole) == 40 * 2 * 144
    assert tensor(0, 1 << 20) == whole
    assert tensor(0, 288 * 8) == whole  # 8 rows at a time: the same bits in the same places
    assert tensor(1, 1 << 20) != whole
    with pytest.raises(ValueError, match="multiple of 256"):
        next(tensor_chunks(T.Q4_K, 4, 100, np.random.default_rng(0)))


@pytest.mark.parametrize("preset_file", ["tiny_file", "tiny_moe_file"])
def test_both_engines_load_it_and_agree(preset_file: str, request: pytest.FixtureRequest) -> None:
    """Ours and llama.cpp on the same random file, dense and mixture-of-experts: finite logits of unit size at
    every position, and the same top-1 token (bounds measured 2026-12-06 on an Intel Xeon, AVX2)."""
    tiny_file = request.getfixturevalue(preset_file)
    model = load_model(tiny_file, n_ctx=128, threads=2)
    ids = model.tokenize(TEXT, special=False)
    assert len(ids) > 10
    ours = np.asarray(model.session().eval_all(ids), np.float32)  # (n_tok, n_vocab)
    out = subprocess.run(
        [str(ensure_server_python()), "-c", _LLAMA, str(tiny_file), json.dumps(ids)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = np.array(json.loads(out.stdout.strip().splitlines()[-1]), np.float32)  # (n_tok, n_vocab)
    assert ours.shape == theirs.shape == (len(ids), 49152)
    for logits in (ours, theirs):
        assert np.isfinite(logits).all()
        assert (0.8 < logits.std(axis=1)).all() and (logits.std(axis=1) < 1.3).all()  # measured 1.05..1.07
    # Measured (llama.cpp 0.3.36, AVX2): top-1 17 of 18 (random logits have near-ties), |Δ| mean 0.026, max 0.26;
    # llama.cpp rounds the activations to 8 bits for its K-quant products. The MoE file (Xeon family 6 model 207,
    # AVX-512 VNNI): top-1 17 of 18, |Δ| mean 0.021, max 0.17.
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).mean() >= 0.85
    assert np.abs(ours - theirs).mean() < 0.05
    assert np.abs(ours - theirs).max() < 0.5


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K])
def test_widest_rows_keep_normal_scales(ggml_type: T) -> None:
    """The 8B shape's ffn_down rows (14336 wide, the smallest weights): block scales stay normal float16 numbers,
    the weights' spread stays 1/sqrt(n_in)."""
    n_in = PRESETS["llama-8b"].d_ff
    rows = next(tensor_chunks(ggml_type, 8, n_in, np.random.default_rng(3)))  # (8, row bytes)
    blocks = rows.reshape(-1, 144 if ggml_type == T.Q4_K else 210)  # (n_blocks, block bytes)
    d = np.ascontiguousarray(blocks[:, :2] if ggml_type == T.Q4_K else blocks[:, 208:]).view(np.float16)
    assert (d.astype(np.float32) >= np.finfo(np.float16).smallest_normal).all()
    w = gguf.quants.dequantize(rows, ggml_type)  # (8, n_in)
    assert 0.6 < w.std() * np.sqrt(n_in) < 1.4


def test_moe_plan_is_qwen3_30b_a3b_layer() -> None:
    """The MoE preset's tensors: Qwen3-30B-A3B's per-layer shapes (experts stacked in 3-D tensors, the router F32,
    q/k norms of a 128-wide head), Q6_K on ffn_down_exps and attn_v in llama.cpp's Q4_K_M layers."""
    shape = PRESETS["qwen3moe-30b-a3b"]
    tensors = {name: (t, s) for name, t, s in plan(shape, "q4_k_m", 49152)}
    assert len([n for n in tensors if n.startswith("blk.")]) == 12 * 12  # 4 attention, router, 3 experts, 4 norms
    assert tensors["blk.0.ffn_gate_inp.weight"] == (T.F32, (128, 2048))
    assert tensors["blk.5.ffn_gate_exps.weight"] == (T.Q4_K, (128, 768, 2048 // 256 * 144))
    assert tensors["blk.3.ffn_down_exps.weight"] == (T.Q6_K, (128, 2048, 768 // 256 * 210))  # use_more_bits(3, 12)
    assert tensors["blk.4.ffn_down_exps.weight"][0] == T.Q4_K
    assert tensors["blk.0.attn_q.weight"] == (T.Q4_K, (4096, 2048 // 256 * 144))
    assert tensors["blk.0.attn_output.weight"] == (T.Q4_K, (2048, 4096 // 256 * 144))
    assert tensors["blk.0.attn_k.weight"][1] == (512, 2048 // 256 * 144)
    assert tensors["blk.0.attn_q_norm.weight"] == tensors["blk.0.attn_k_norm.weight"] == (T.F32, (128,))
