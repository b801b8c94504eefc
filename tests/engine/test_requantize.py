"""A draft model's weights re-encoded at load (engine/requantize.py, `--draft-type`): ggml's Q4_0 quantizer bit for
bit, matrices that dequantize as gguf's own round trip, fewer bytes a token, and replies still plain decoding's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from chatapp.settings import DRAFT_TYPES, ConfigError, load_settings
from engine import load_model
from engine.chat import ChatSession
from engine.errors import SettingsError
from engine.formats import q4_0
from engine.kernels import WeightMatrix, dequantize
from engine.requantize import TYPES, parse_type, requantize_matrix
from engine.sampling import SamplingSettings
from engine.speculative import ModelDrafter

from .test_speculative import REWRITE, assert_same_greedy, ids_of, run


def test_q4_0_quantizer_writes_ggml_reference_bytes() -> None:
    """Random rows over six orders of magnitude, an all-zero block, equal magnitudes of both signs (the first
    wins), and values that land exactly on a rounding edge: the same bytes as gguf-py's port of
    quantize_row_q4_0_ref."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 256)) * 10.0 ** rng.uniform(-4, 2, (64, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = np.linspace(-1, 1, 32, dtype=np.float32)
    x[1, 3], x[1, 9] = -2.0, 2.0  # equal magnitudes: -2 comes first, so d = 0.25
    x[2, :32] = np.arange(-16, 16, dtype=np.float32) / 2  # multiples of d/2: every value on a rounding edge
    ours = q4_0.quantize(x)
    theirs = gguf.quants.quantize(x, T.Q4_0)
    assert ours.shape == theirs.shape == (64, 256 // 32 * 18)
    assert np.array_equal(ours, theirs)


def test_draft_types_are_the_engines() -> None:
    assert set(DRAFT_TYPES) == set(TYPES) | {"file"}
    assert parse_type("Q4_0") == T.Q4_0 and parse_type("file") is None
    with pytest.raises(SettingsError, match="draft type 'q2_k': choose one of file, q4_0"):
        parse_type("q2_k")


def test_config_refuses_an_unknown_draft_type(tmp_path, isolated_dirs) -> None:
    config = tmp_path / "config.toml"
    config.write_text('draft_type = "file"\n')
    assert load_settings(config_file=config).draft_type == "file"
    assert load_settings().draft_type == "file"  # the default
    config.write_text('draft_type = "q3"\n')
    with pytest.raises(ConfigError, match="draft_type"):
        load_settings(config_file=config)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight"])
def test_a_requantized_matrix_dequantizes_as_ggufs_round_trip(qwen_model, name: str) -> None:
    """Q5_0, Q8_0 and Q6_K tensors of the real 0.5B file: the packed Q4_0 weight dequantizes to exactly what gguf
    gets by dequantizing the file's bytes and quantizing them to Q4_0, and keeps no copy of those bytes."""
    t = qwen_model.file.tensors[name]
    w = WeightMatrix.from_raw(name, t.ggml_type, t.shape[1], t.shape[0], t.data)
    q = requantize_matrix(w, T.Q4_0)
    expected = gguf.quants.dequantize(gguf.quants.quantize(gguf.quants.dequantize(t.data, t.ggml_type), T.Q4_0), T.Q4_0)
    assert (q.ggml_type, q.rows, q.cols) == (T.Q4_0, w.rows, w.cols) and q.packed is not None
    assert np.array_equal(dequantize(q), expected.reshape(w.rows, w.cols))
    assert q.data.strides == (0, 0)  # a stand-in: the Q4_0 bytes live only in the packed copy
    assert q.nbytes == q.packed.nbytes < w.data.nbytes


def test_matrices_with_no_more_bits_stay_as_stored(qwen_model) -> None:
    """Q4_K (4.5 bits a weight, as Q4_0) keeps its finer scales: the same object, untouched."""
    w = next(lw.w_down for lw in qwen_model.weights.layers if lw.w_down.ggml_type == T.Q4_K)
    assert requantize_matrix(w, T.Q4_0) is w


@pytest.fixture(scope="module")
def smollm2_q4_0(smollm2_path):
    return load_model(smollm2_path, n_ctx=2048, requantize=T.Q4_0)


def test_a_requantized_model_reads_fewer_bytes_and_still_predicts(smollm2_model, smollm2_q4_0) -> None:
    """SmolLM2's Q4_1 layers (5 bits a weight) and Q8_0 output head (8.5) as Q4_0 (4.5): a token reads 72% of
    the bytes, and the next-token choices over a piece of code mostly agree with the file's: 0.78 measured on
    this text (every kernel set computes the same bits), where a broken re-encoding agrees on next to none.
    A 135M model quantized twice is the hard case; Qwen2.5-Coder-0.5B's Q5_0 -> Q4_0 agreed on 0.96."""
    before, after = smollm2_model.weights.decode_bytes(), smollm2_q4_0.weights.decode_bytes()
    assert after < 0.8 * before
    assert smollm2_q4_0.requantized.startswith("Q4_0, ") and smollm2_model.requantized == ""
    ids = smollm2_model.tokenize(REWRITE[0].content)
    agree = (smollm2_model.logits(ids).argmax(1) == smollm2_q4_0.logits(ids).argmax(1)).mean()
    assert agree > 0.65, agree


def test_greedy_with_a_requantized_draft_equals_plain_decoding(smollm2_model, smollm2_q4_0) -> None:
    """The draft guesses with other numbers than the target's, so some guesses may fail; the reply is plain
    decoding's token for token all the same."""
    greedy = SamplingSettings(temperature=0.0, max_tokens=48)
    plain = ids_of(run(ChatSession(smollm2_model, greedy), REWRITE)[0])
    drafter = ModelDrafter(smollm2_q4_0, smollm2_model)
    events, stats = run(ChatSession(smollm2_model, greedy, drafter=drafter), REWRITE)
    assert_same_greedy(plain, ids_of(events))
    assert stats.draft_accepted > 0


def test_no_requantizing_on_a_device(smollm2_path) -> None:
    """The device path uploads the file's blocks: re-encoding is the CPU's, and the model says it kept them."""
    model = load_model(smollm2_path, n_ctx=64, device="numpy", requantize=T.Q4_0, compile_kernels=False)
    assert model.requantized == ""
    assert any("re-encoding to Q4_0 is CPU only" in w for w in model.warnings)
