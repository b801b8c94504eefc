"""The forward pass's float operations against an array module `xp`: the CPU layer's, operation by operation.

Same formulas, same order, same float32 / float16 roundings as the CPU engine, so that the offloaded layers
and the CPU layers compute the same numbers up to the products' summation order.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

Array = Any  # an xp.ndarray


def rms_norm(xp: ModuleType, x: Array, w: Array, eps: float) -> Array:
    # x (t, d) -> (t, d)
    return x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)) * w


def layer_norm(xp: ModuleType, x: Array, w: Array, b: Array, eps: float) -> Array:
    # x (t, d) -> (t, d)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    return xc * (1.0 / xp.sqrt(xp.mean(xc * xc, axis=-1, keepdims=True) + eps)) * w + b


def half_round(xp: ModuleType, x: Array) -> Array:
    """x rounded to the nearest float16 value, kept as float32."""
    return x.astype(xp.float16).astype(xp.float32)


def silu(xp: ModuleType, x: Array) -> Array:
    return x / (1.0 + xp.exp(-x))


def gelu(xp: ModuleType, x: Array) -> Array:
    # The tanh approximation, as ggml uses.
    return 0.5 * x * (1.0 + xp.tanh(np.float32(0.7978845608) * (x + np.float32(0.044715) * x * x * x)))


def geglu(xp: ModuleType, gate: Array, up: Array) -> Array:
    """gelu(gate) * up as ggml's CPU backend rounds it (engine.kernels.attention.gelu_half): gate rounded to
    float16, its GELU rounded to float16; 0 below -10 and gate itself above 10."""
    g = half_round(xp, gate)
    y = half_round(xp, gelu(xp, g))
    y = xp.where(gate <= -10.0, np.float32(0.0), xp.where(gate >= 10.0, gate, y))
    return y * up


def soft_cap(xp: ModuleType, x: Array, cap: float) -> Array:
    """cap · tanh(x / cap)."""
    return np.float32(cap) * xp.tanh(x / np.float32(cap))


def apply_rope(xp: ModuleType, x: Array, cos: Array, sin: Array, rope_dim: int, neox: bool) -> Array:
    """Rotate the leading rope_dim dims of every head. x (t, heads, head_dim); cos/sin (t, rope_dim/2)."""
    half = rope_dim // 2
    if neox:  # pairs (i, i + half)
        x1, x2 = x[..., :half], x[..., half:rope_dim]
    else:  # adjacent pairs (2i, 2i+1)
        x1, x2 = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
    c, s = cos[:, None, :], sin[:, None, :]  # (t, 1, half)
    r1 = x1 * c - x2 * s  # (t, heads, half)
    r2 = x1 * s + x2 * c
    out = x.copy()
    if neox:
        out[..., :half], out[..., half:rope_dim] = r1, r2
    else:
        out[..., 0:rope_dim:2], out[..., 1:rope_dim:2] = r1, r2
    return out


def attention(
    xp: ModuleType, q: Array, k: Array, v: Array, start: int, lo: int = 0,
    scale: float | None = None, window: int = 0, softcap: float = 0.0,
) -> Array:  # fmt: skip
    """Causal attention of t new queries at positions start.. over the keys at positions lo..start + t - 1.

    q (t, n_head, hd); k, v (n_kv, T, hd), T = start + t - lo -> (t, n_head·hd). Scores are scale · q·k
    (default 1/√hd), soft-capped when softcap > 0; a query sees keys up to its own position, and only the
    last `window` of them when window > 0. Query head h reads kv head h // (n_head/n_kv).
    """
    t, n_head, hd = q.shape
    n_kv, n_pos, _ = k.shape
    group = n_head // n_kv
    qg = q.transpose(1, 0, 2).reshape(n_kv, group * t, hd)  # (n_kv, group·t, hd)
    scores = xp.matmul(qg, k.transpose(0, 2, 1))  # (n_kv, group·t, T)
    scores *= np.float32(1.0 / np.sqrt(hd) if scale is None else scale)
    if softcap > 0:
        scores = soft_cap(xp, scores, softcap)
    key_pos = xp.arange(lo, lo + n_pos)[None, :]  # (1, T)
    query_pos = xp.arange(start, start + t)[:, None]  # (t, 1)
    hidden = key_pos > query_pos  # (t, T)
    if window > 0:
        hidden = hidden | (key_pos <= query_pos - window)
    if bool(hidden.any()):
        scores = scores.reshape(n_kv, group, t, n_pos)
        scores = xp.where(hidden, np.float32(-np.inf), scores).reshape(n_kv, group * t, n_pos)
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = xp.matmul(scores, v)  # (n_kv, group·t, hd)
    return out.reshape(n_head, t, hd).transpose(1, 0, 2).reshape(t, n_head * hd)
