"""engine.layer's operations on the CPU for a pass of t tokens: each op one compiled kernel over all t rows
(engine/layer.py `run_layer` says in which order).

Temporaries come from the model's Scratch, one buffer per name, reused by the next layer and the next pass.
With `rowwise`, every row is computed as the one-token layer (decode.layer) computes its token, bit for bit:
norms, products, attention and the ungated FFN's GELU row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import (
    causal_attention,
    geglu,
    gelu_rows,
    layer_norm_rows,
    matmul,
    rms_norm_rows,
    rope_into_cache,
    swiglu,
)
from .scratch import Scratch

if TYPE_CHECKING:
    from ..layer import Attention, DenseFfn, LayerSpec, Linear, Norm
    from ..moe import RouterFfn


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    # x (t, d) -> (t, d)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    return xc * (1.0 / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)) * w + b


def gelu(x: np.ndarray) -> np.ndarray:
    # The tanh approximation, as ggml uses.
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608) * (x + np.float32(0.044715) * x * x * x)))


def norm_rows(x: np.ndarray, norm: Norm, rowwise: bool, out: np.ndarray | None = None) -> np.ndarray:
    """x (t, n) -> normalized (t, n), into out where given (x itself may be out); the result is out only where
    a kernel runs: a LayerNorm of several rows, not rowwise, is NumPy's."""
    if norm.kind == "rms":
        return rms_norm_rows(x, norm.weight, norm.eps, out=out)
    if norm.bias is None:
        raise ValueError("a LayerNorm needs its bias")
    if rowwise:  # each row as the one-token layer normalizes it
        return layer_norm_rows(x, norm.weight, norm.bias, norm.eps, out=out)
    return layer_norm(x, norm.weight, norm.bias, norm.eps)


class PromptOps:
    """engine.layer.LayerOps for t tokens at positions start..; kv_k[i], kv_v[i] (n_kv, rows, head_dim) float16
    are layer first + i's cache (engine.model.KVCache)."""

    def __init__(
        self, kv_k: np.ndarray | Sequence[np.ndarray], kv_v: np.ndarray | Sequence[np.ndarray], first: int, start: int,
        t: int, rowwise: bool, scratch: Scratch,
    ):  # fmt: skip
        self.kv_k, self.kv_v, self.first = kv_k, kv_v, first
        self.start, self.t, self.rowwise, self.work = start, t, rowwise, scratch

    def _cache(self, layer: LayerSpec) -> tuple[np.ndarray, np.ndarray]:
        i = layer.index - self.first
        return self.kv_k[i], self.kv_v[i]  # (n_kv, rows, hd) each

    def _product(self, name: str, lin: Linear, h: np.ndarray, again: bool = False) -> np.ndarray:
        """(t, rows) in the buffer `name`, bias added; again: h is the last product's input, unchanged."""
        y = matmul(
            lin.w, h, out=self.work.take(name, (self.t, lin.w.rows)), scratch=self.work, same_input=again,
            rowwise=self.rowwise,
        )  # fmt: skip
        if lin.b is not None:
            y += lin.b
        return y

    def norm(self, x: np.ndarray, norm: Norm) -> np.ndarray:
        return norm_rows(x, norm, self.rowwise, out=self.work.take("norm", x.shape))

    def post_norm(self, y: np.ndarray, norm: Norm) -> np.ndarray:
        return norm_rows(y, norm, self.rowwise, out=y)

    def qkv(self, h: np.ndarray, att: Attention) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # q (t, n_head·hd), k, v (t, n_kv·hd)
        return self._product("q", att.q, h), self._product("k", att.k, h, True), self._product("v", att.v, h, True)

    def head_norm(self, y: np.ndarray, norm: Norm) -> np.ndarray:
        hd = norm.weight.shape[0]
        heads = y.reshape(-1, hd)  # (t·heads, hd)
        return norm_rows(heads, norm, self.rowwise, out=heads).reshape(y.shape)

    def rope_and_store(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, layer: LayerSpec) -> np.ndarray:
        att, (start, t) = layer.attention, (self.start, self.t)
        rope = att.rope
        kc, vc = self._cache(layer)
        cos, sin = rope.cos[start : start + t], rope.sin[start : start + t]  # (t, rope_dim/2)
        rope_into_cache(q, k, v, kc, vc, start, cos, sin, (att.n_head, att.n_kv, att.head_dim, rope.dim, rope.neox))
        return q

    def attend(self, q: np.ndarray, layer: LayerSpec) -> np.ndarray:
        att, t = layer.attention, self.t
        kc, vc = self._cache(layer)
        a = self.work.take("attention", (t, att.n_head * att.head_dim))  # (t, n_head·hd)
        return causal_attention(
            q.reshape(t, att.n_head, att.head_dim), kc, vc, self.start, att.scale, att.window, att.softcap, out=a,
            rowwise=self.rowwise, scratch=self.work,
        )  # fmt: skip

    def attn_out(self, a: np.ndarray, att: Attention) -> np.ndarray:
        return self._product("o", att.out, a)  # (t, d)

    def dense_ffn(self, h: np.ndarray, ffn: DenseFfn) -> np.ndarray:
        if ffn.gate is not None:  # (t, d_ff): act(gate) * up, into gate's buffer (swiglu, geglu)
            gate, up = self._product("gate", ffn.gate, h), self._product("up", ffn.up, h, again=True)
            h = (swiglu if ffn.activation == "swiglu" else geglu)(gate, up, out=gate)
        else:
            h = (gelu_rows if self.rowwise else gelu)(self._product("up", ffn.up, h))
        return self._product("down", ffn.down, h)  # (t, d)

    def router_ffn(self, h: np.ndarray, ffn: RouterFfn) -> np.ndarray:
        from ..moe import router_ffn  # engine.moe builds on this package

        return router_ffn(h, ffn)  # (t, d); each row as a single token's, rowwise or not

    def residual(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> np.ndarray:
        if scale != 1.0:
            y *= scale  # y is a branch's output, no longer needed
        x += y
        return x
