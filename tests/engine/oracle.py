"""The forward pass's float operations stated in NumPy, one by one, from their definitions: the oracle the
compiled kernels of engine/kernels and the device ops of engine/gpu/ops.py are held to. Written apart from both
(nothing here is imported from engine/), so that a mistake copied into one is not copied into its check.
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
    """Rotate the leading rope_dim dims of every head: rotation i turns the pair of dims (a, b) into
    (a·cos - b·sin, a·sin + b·cos). x (t, heads, head_dim); cos/sin (t, rope_dim/2)."""
    i = np.arange(rope_dim // 2)
    # neox pairs dim i with i + rope_dim/2; llama GGUFs (permuted for it) pair 2i with 2i + 1
    first, second = (i, i + rope_dim // 2) if neox else (2 * i, 2 * i + 1)
    a, b = x[..., first], x[..., second]  # (t, heads, rope_dim/2)
    c, s = cos[:, None, :], sin[:, None, :]  # (t, 1, rope_dim/2), the same angles for every head
    rotated = x.copy()
    rotated[..., first] = a * c - b * s
    rotated[..., second] = a * s + b * c
    return rotated


def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, lo: int = 0,
    scale: float | None = None, window: int = 0, softcap: float = 0.0,
) -> np.ndarray:  # fmt: skip
    """Causal attention of t new queries at positions start.. over keys at positions lo..: the definition, one
    query of one head at a time, in float64 (what kernels.causal_attention and the device's attention compute).

    q (t, n_head, hd); k, v (n_kv, T, hd) -> float32 (t, n_head·hd). Scores scale · q·k (default 1/√hd),
    soft-capped when softcap > 0; a query sees keys up to its own position, the last `window` of them when
    window > 0. Query head h reads kv head h // (n_head/n_kv).
    """
    t, n_head, hd = q.shape
    n_kv, n_keys, _ = k.shape
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    key_pos = lo + np.arange(n_keys)  # the position of each key
    out = np.zeros((t, n_head, hd))
    for i in range(t):
        pos = start + i
        seen = key_pos <= pos
        if window > 0:
            seen &= key_pos > pos - window
        for head in range(n_head):
            kv = head // (n_head // n_kv)
            keys, values = k[kv, seen].astype(np.float64), v[kv, seen].astype(np.float64)  # (seen, hd)
            scores = keys @ q[i, head].astype(np.float64) * scale  # (seen,)
            if softcap > 0:
                scores = softcap * np.tanh(scores / softcap)
            weights = np.exp(scores - scores.max())
            out[i, head] = weights @ values / weights.sum()
    return out.reshape(t, n_head * hd).astype(np.float32)
