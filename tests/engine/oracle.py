"""The forward pass's float operations stated in NumPy, one by one: the oracle the compiled kernels of
engine/kernels and the device ops of engine/gpu/ops.py are held to. No product path runs them.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x (t, d) -> (t, d). The NumPy statement (the GPU path's reference); the CPU pass runs kernels.rms_norm_rows.
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w


def half_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest float16 value, kept as float32."""
    return x.astype(np.float16).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int, neox: bool) -> np.ndarray:
    """Rotate the leading rope_dim dims of every head. x (t, heads, head_dim); cos/sin (t, rope_dim/2)."""
    half = rope_dim // 2
    if neox:  # pairs (i, i + half)
        x1, x2 = x[..., :half], x[..., half:rope_dim]
    else:  # adjacent pairs (2i, 2i+1): llama GGUFs were permuted for this
        x1, x2 = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
    c, s = cos[:, None, :], sin[:, None, :]  # (t, 1, half)
    r1 = x1 * c - x2 * s
    r2 = x1 * s + x2 * c
    out = x.copy()
    if neox:
        out[..., :half], out[..., half:rope_dim] = r1, r2
    else:
        out[..., 0:rope_dim:2], out[..., 1:rope_dim:2] = r1, r2
    return out


def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, lo: int = 0,
    scale: float | None = None, window: int = 0, softcap: float = 0.0,
) -> np.ndarray:  # fmt: skip
    """Causal attention of t new queries at positions start.. over keys at positions lo..: the NumPy statement
    of what kernels.causal_attention computes.

    q (t, n_head, hd); k, v (n_kv, T, hd) -> (t, n_head·hd). Scores scale · q·k (default 1/√hd), soft-capped
    when softcap > 0; a query sees keys up to its own position, the last `window` of them when window > 0.
    Query head h reads kv head h // (n_head/n_kv).
    """
    t, n_head, hd = q.shape
    n_kv, n_pos, _ = k.shape
    group = n_head // n_kv
    qg = q.transpose(1, 0, 2).reshape(n_kv, group * t, hd)  # (n_kv, group·t, hd)
    scores = np.matmul(qg, k.transpose(0, 2, 1))  # (n_kv, group·t, T)
    scores *= np.float32(1.0 / np.sqrt(hd) if scale is None else scale)
    if softcap > 0:
        scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
    key_pos, query_pos = np.arange(lo, lo + n_pos)[None, :], np.arange(start, start + t)[:, None]
    hidden = key_pos > query_pos  # (t, T)
    if window > 0:
        hidden |= key_pos <= query_pos - window
    scores = scores.reshape(n_kv, group, t, n_pos)
    scores[:, :, hidden] = -np.inf
    scores = scores.reshape(n_kv, group * t, n_pos)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v)  # (n_kv, group·t, hd)
    return out.reshape(n_head, t, hd).transpose(1, 0, 2).reshape(t, n_head * hd)
