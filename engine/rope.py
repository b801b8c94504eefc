"""RoPE's rotation tables: cos and sin of every position's angles, plain, linearly scaled or YaRN-scaled.

Every path reads these tables (the prompt's and one token's CPU kernels, the GPU offload), so a scaling lives
here alone. The formulas are llama.cpp's (ggml-cpu's `rope_yarn`, `rope_yarn_ramp`, `ggml_rope_yarn_corr_dims`;
the attention factor as `llama_context` resolves it), so a file opens with the positions llama.cpp gives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# ggml's defaults for the frequencies YaRN corrects: rotations faster than beta_fast turns over the original
# context keep their angles (extrapolation), slower than beta_slow are interpolated, a linear ramp between.
BETA_FAST, BETA_SLOW = 32.0, 1.0


@dataclass(frozen=True)
class Yarn:
    """YaRN's corrections on top of the linear position scaling 1/factor (rope.scaling.type = yarn)."""

    factor: float  # rope.scaling.factor: the context extension
    ctx_orig: int  # rope.scaling.original_context_length: the context the model was trained for
    attn_factor: float = 1.0  # rope.scaling.attn_factor: multiplies the magnitude of cos and sin
    beta_fast: float = BETA_FAST
    beta_slow: float = BETA_SLOW
    ext_factor: float = 1.0  # weight of the extrapolated angle in the ramp (llama.cpp: 1 for yarn files)


def corr_dims(n_dims: int, ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims, in float32 as ggml: the first and last rotation pair of the ramp."""

    def dim(n_rot: float) -> np.float32:  # the pair whose rotation turns n_rot times over ctx_orig positions
        f = np.float32
        return f(n_dims) * f(math.log(f(ctx_orig) / (f(n_rot) * f(2.0) * f(math.pi)))) / (f(2.0) * f(math.log(f(base))))

    start = math.floor(dim(beta_fast))
    end = math.ceil(dim(beta_slow))
    return float(max(0, start)), float(min(n_dims - 1, end))


def magnitude(yarn: Yarn, freq_scale: float) -> float:
    """What multiplies cos and sin: llama_context's yarn_attn_factor (get_mscale(factor), the 1 + 0.1 ln factor
    that ggml applies cancelled, times rope.scaling.attn_factor) times ggml's own 1 + 0.1 ln(1/freq_scale)."""
    f = np.float32
    if yarn.ext_factor == 0:  # llama.cpp corrects nothing then
        return float(f(yarn.attn_factor))
    factor = f(1.0) / (f(1.0) / f(yarn.factor))  # llama.cpp keeps 1/factor and inverts it back
    attn = f(1.0) if factor <= 1 else f(0.1) * f(math.log(factor)) + f(1.0)
    attn = attn * (f(1.0) / (f(1.0) + f(0.1) * f(math.log(factor))))
    attn = attn * f(yarn.attn_factor)
    return float(attn * (f(1.0) + f(0.1) * f(math.log(f(1.0) / f(freq_scale)))))


def rope_tables(
    rope_dim: int, base: float, freq_scale: float, n_pos: int, freq_factors: np.ndarray | None = None,
    yarn: Yarn | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """cos and sin of positions 0..n_pos-1: each (n_pos, rope_dim/2) float32, pair i at angle
    pos · base^(-2i/rope_dim) / freq_factors[i], scaled by freq_scale (linear: 1/factor); with YaRN the pairs
    below the ramp keep the unscaled angle, and cos and sin carry the attention factor."""
    half = rope_dim // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / rope_dim)  # (half,)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    extrap = np.outer(np.arange(n_pos, dtype=np.float64), inv_freq)  # (n_pos, half)
    angles = extrap * freq_scale
    scale = 1.0
    if yarn is not None and yarn.ext_factor != 0:
        lo, hi = corr_dims(rope_dim, yarn.ctx_orig, base, yarn.beta_fast, yarn.beta_slow)
        y = (np.arange(half, dtype=np.float64) - lo) / max(0.001, hi - lo)  # (half,)
        mix = (1.0 - np.clip(y, 0.0, 1.0)) * yarn.ext_factor  # 1: extrapolate (fast pairs), 0: interpolate
        angles = angles * (1.0 - mix) + extrap * mix
    if yarn is not None:
        scale = magnitude(yarn, freq_scale)
    return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)
