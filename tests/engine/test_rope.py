"""RoPE's tables (engine/rope.py) against a transcription of llama.cpp's formulas, one value at a time."""

from __future__ import annotations

import numpy as np
import pytest

from engine import UnsupportedModelError
from engine.config import ModelConfig
from engine.rope import Yarn, corr_dims, rope_tables

from .synthetic import rope_angle


def transcribed(n_dims: int, base: float, n_pos: int, factors: np.ndarray, yarn: tuple | None, linear: float = 1.0):
    """(cos, sin) (n_pos, n_dims/2) from tests/engine/synthetic.rope_angle (llama.cpp's rope_yarn, per value)."""
    cos = np.empty((n_pos, n_dims // 2))
    sin = np.empty_like(cos)
    for pos in range(n_pos):
        for i in range(n_dims // 2):
            angle, mag = rope_angle(pos, i, n_dims, base, factors[i], yarn)
            cos[pos, i], sin[pos, i] = np.cos(angle * linear) * mag, np.sin(angle * linear) * mag
    return cos, sin


@pytest.mark.parametrize(
    ("n_dims", "base", "yarn", "freq_factors"),
    [
        (128, 1e6, (4.0, 32768, 1.0), False),  # Qwen3's 128k files: factor 4 over 32k
        (64, 10000.0, (8.0, 2048, 0.8), True),  # a wide ramp, the attention factor, frequency divisors
        (32, 10000.0, (4.0, 16, 0.9), False),  # the synthetic model of test_architectures
    ],
)
def test_yarn_tables_match_llama_cpp_formula(n_dims: int, base: float, yarn: tuple, freq_factors: bool) -> None:
    n_pos = 300
    factors = np.linspace(1.0, 4.0, n_dims // 2) if freq_factors else np.ones(n_dims // 2)
    cos, sin = rope_tables(n_dims, base, 1.0 / yarn[0], n_pos, factors if freq_factors else None,
                           Yarn(factor=yarn[0], ctx_orig=yarn[1], attn_factor=yarn[2]))  # fmt: skip
    want_cos, want_sin = transcribed(n_dims, base, n_pos, factors, yarn)
    np.testing.assert_allclose(cos, want_cos, atol=2e-7, rtol=0)  # float32 rounding of values up to ~1.2
    np.testing.assert_allclose(sin, want_sin, atol=2e-7, rtol=0)
    lo, hi = corr_dims(n_dims, yarn[1], base, 32.0, 1.0)
    assert 0 <= lo < hi <= n_dims - 1  # the ramp lies inside the pairs: both sides of it are checked above


def test_linear_scaling_divides_positions() -> None:
    cos, sin = rope_tables(64, 10000.0, 0.25, 100)
    want_cos, want_sin = transcribed(64, 10000.0, 100, np.ones(32), None, linear=0.25)
    np.testing.assert_allclose(cos, want_cos, atol=2e-7, rtol=0)
    np.testing.assert_allclose(sin, want_sin, atol=2e-7, rtol=0)


def _meta(**rope: object) -> dict:
    meta = {"general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.attention.head_count": 4,
            "qwen3.block_count": 2, "qwen3.feed_forward_length": 128, "qwen3.context_length": 131072}  # fmt: skip
    return meta | {f"qwen3.rope.scaling.{k}": v for k, v in rope.items()}


def test_config_reads_yarn_and_linear() -> None:
    cfg = ModelConfig.from_metadata(_meta(type="yarn", factor=4.0, original_context_length=32768), 100)
    assert cfg.rope_scale == 0.25 and cfg.rope_yarn == Yarn(factor=4.0, ctx_orig=32768, attn_factor=1.0)
    cfg = ModelConfig.from_metadata(_meta(type="yarn", factor=4.0, attn_factor=0.5), 100)
    assert cfg.rope_yarn == Yarn(factor=4.0, ctx_orig=131072, attn_factor=0.5)  # no original: the trained context
    cfg = ModelConfig.from_metadata(_meta(type="linear", factor=2.0), 100)
    assert cfg.rope_scale == 0.5 and cfg.rope_yarn is None


def test_unimplemented_scaling_is_refused_in_one_line() -> None:
    one_line = r"^metadata qwen3\.rope\.scaling\.type: 'longrope' rope scaling is not supported$"
    with pytest.raises(UnsupportedModelError, match=one_line):
        ModelConfig.from_metadata(_meta(type="longrope", factor=4.0), 100)
