"""One transformer layer, written once: what it is made of (`LayerSpec`) and the order of its operations
(`run_layer`), over the few operations each backend implements (`LayerOps`).

    x -> norm -> q, k, v [-> q/k norm] -> RoPE, k and v into the cache -> attention -> output projection
      [-> post-norm] -> + x -> norm -> FFN [-> post-norm] -> + x

`layer_specs` builds every layer's spec from the model's config (the family's description resolved against the
file, engine/config.py) and that layer's weights: it is the one place where a family's choices -- norm kind
and eps, q/k norms, post-norms, biases, RoPE tables and pairing, attention scale, soft-cap and window, FFN
kind -- become named fields. The executors read nothing else:

    engine/kernels/prompt_ops.py  PromptOps: the CPU, a pass of several tokens, each op a compiled kernel
    engine/kernels/one_token.py   DecodeLayer: the CPU, one token, the whole layer in one compiled call
                                  (a specialisation of run_layer, fed from the spec by `decode_args`)
    engine/gpu/offload.py         DeviceOps: the same ops on CuPy arrays (NumPy in the tests)

The spec's classes compare by identity (eq=False): they hold arrays, which have no single truth value.

A new kind of FFN (a mixture-of-experts router) is a variant of `Ffn` whose `apply` names its op, and that op
in PromptOps and DeviceOps; `DecodeLayer.fits` declines a spec it has no kernel for, so such layers take the
per-op path for single tokens too until the fused kernel learns them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from . import rope
from .kernels import WeightMatrix
from .moe import ExpertTensor, RouterFfn

if TYPE_CHECKING:
    from .config import ModelConfig
    from .weights import Weights

Array = Any  # a float32 array of the backend running the layer: NumPy on the CPU, CuPy on a device
Matrix = Any  # a weight: engine.kernels.WeightMatrix in the host's spec, engine.gpu.matrix.DeviceMatrix on a device


@dataclass(frozen=True, eq=False)
class Norm:
    kind: str  # "rms": x / rms(x) · weight; "layer": (x - mean) / std(x) · weight + bias
    weight: Array  # (n,)
    bias: Array | None  # (n,) LayerNorm only
    eps: float


@dataclass(frozen=True, eq=False)
class Linear:
    w: Matrix  # (rows, cols): x (t, cols) -> (t, rows)
    b: Array | None  # (rows,)


@dataclass(frozen=True, eq=False)
class Rope:
    dim: int  # leading dims of each head that rotate; 0: none (learned positions)
    neox: bool  # rotate pairs (i, i + dim/2); False: adjacent pairs (2i, 2i+1), as llama GGUFs expect
    cos: Array  # (n_pos, dim/2) float32: every position's angles, this layer's base and scale
    sin: Array


@dataclass(frozen=True, eq=False)
class Attention:
    n_head: int  # query heads
    n_kv: int  # key/value heads; query head h reads kv head h // (n_head / n_kv)
    head_dim: int
    q: Linear  # (n_head·head_dim, d)
    k: Linear  # (n_kv·head_dim, d)
    v: Linear
    q_norm: Norm | None  # before RoPE: per head, (head_dim,), or over the whole row, (n_head·head_dim,)
    k_norm: Norm | None
    rope: Rope
    scale: float  # multiplies q·k
    softcap: float  # scores become cap·tanh(scores / cap) before the softmax; 0: none
    window: int  # keys a query sees, itself included; 0: every earlier position
    out: Linear  # (d, n_head·head_dim)

    def matrices(self) -> list[Matrix]:
        return [self.q.w, self.k.w, self.v.w, self.out.w]


@dataclass(frozen=True, eq=False)
class DenseFfn:
    """down(act(gate(h)) · up(h)), or down(act(up(h))) without a gate."""

    activation: str  # "swiglu": silu(gate)·up; "geglu": gelu_tanh(gate)·up; "gelu": gelu_tanh(up), no gate
    gate: Linear | None  # (d_ff, d), gated activations only
    up: Linear  # (d_ff, d)
    down: Linear  # (d, d_ff)

    def apply(self, ops: LayerOps, h: Array) -> Array:
        return ops.dense_ffn(h, self)

    def matrices(self) -> list[Matrix]:
        return [m.w for m in (self.gate, self.up, self.down) if m is not None]


Ffn = DenseFfn | RouterFfn  # each variant's `apply` calls its own op of LayerOps


@dataclass(frozen=True, eq=False)
class LayerSpec:
    index: int  # the layer's place in the model (its KV cache)
    attn_norm: Norm
    attention: Attention
    attn_post_norm: Norm | None  # on attention's output, before its residual
    ffn_norm: Norm
    ffn: Ffn
    ffn_post_norm: Norm | None  # on the FFN's output, before its residual
    residual_scale: float = 1.0  # multiplies each branch's output before its residual (granite)

    def matrices(self) -> list[Matrix]:
        return [*self.attention.matrices(), *self.ffn.matrices()]

    def norms(self) -> list[Norm]:
        att = self.attention
        named = (self.attn_norm, att.q_norm, att.k_norm, self.attn_post_norm, self.ffn_norm, self.ffn_post_norm)
        return [n for n in named if n is not None]


class LayerOps(Protocol):
    """A backend's operations for `run_layer`, bound to one pass: its KV cache, its positions start.. and its
    buffers. Arrays are the backend's own; each returns its result, which may be its input changed in place."""

    def norm(self, x: Array, norm: Norm) -> Array:
        """x (t, n) -> normalized (t, n); x itself is left as it is (it is the residual stream)."""
        ...

    def post_norm(self, y: Array, norm: Norm) -> Array:
        """A branch's output y (t, d) normalized; y is the caller's no longer, so may be overwritten."""
        ...

    def qkv(self, h: Array, att: Attention) -> tuple[Array, Array, Array]:
        """h (t, d) -> q, k, v, biases added: q of n_head heads, k and v of n_kv, head_dim each."""
        ...

    def head_norm(self, y: Array, norm: Norm) -> Array:
        """q or k normalized in groups of the norm's length: each head (head_dim), or the whole row."""
        ...

    def rope_and_store(self, q: Array, k: Array, v: Array, layer: LayerSpec) -> Array:
        """Rotate q and k for their positions, write k and v into the layer's cache as its types store them
        (float16, llama.cpp's F16 cache, or q8_0 blocks: engine/cache_types.py), and return q rotated and
        rounded to float16 values."""
        ...

    def attend(self, q: Array, layer: LayerSpec) -> Array:
        """Each query over the cached keys it sees (causal, within the window) -> (t, n_head·head_dim)."""
        ...

    def attn_out(self, a: Array, att: Attention) -> Array:
        """The output projection: a (t, n_head·head_dim) -> (t, d)."""
        ...

    def dense_ffn(self, h: Array, ffn: DenseFfn) -> Array:
        """h (t, d) -> (t, d)."""
        ...

    def router_ffn(self, h: Array, ffn: RouterFfn) -> Array:
        """h (t, d) -> (t, d): each token through its chosen experts (engine/moe.py)."""
        ...

    def residual(self, x: Array, y: Array, scale: float) -> Array:
        """x + scale·y, into x where the backend can."""
        ...


def run_layer(ops: LayerOps, layer: LayerSpec, x: Array) -> Array:
    """x (t, d) at the pass's positions through one layer; returns the new x (x itself on the CPU)."""
    att = layer.attention
    h = ops.norm(x, layer.attn_norm)  # (t, d)
    q, k, v = ops.qkv(h, att)
    if att.q_norm is not None:
        q = ops.head_norm(q, att.q_norm)
    if att.k_norm is not None:
        k = ops.head_norm(k, att.k_norm)
    q = ops.rope_and_store(q, k, v, layer)
    a = ops.attend(q, layer)  # (t, n_head·head_dim)
    o = ops.attn_out(a, att)  # (t, d)
    if layer.attn_post_norm is not None:
        o = ops.post_norm(o, layer.attn_post_norm)
    x = ops.residual(x, o, layer.residual_scale)
    h = ops.norm(x, layer.ffn_norm)
    f = layer.ffn.apply(ops, h)  # (t, d)
    if layer.ffn_post_norm is not None:
        f = ops.post_norm(f, layer.ffn_post_norm)
    return ops.residual(x, f, layer.residual_scale)


def rope_tables(
    cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None, local: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position's rotation angles: each (n_pos, rope_dim/2) float32, for the global
    layers or (local) the sliding-window ones, which may have their own base and scale (engine/rope.py)."""
    base, scale = (cfg.rope_base_local, cfg.rope_scale_local) if local else (cfg.rope_base, cfg.rope_scale)
    return rope.rope_tables(cfg.rope_dim, base, scale, n_pos, freq_factors, cfg.rope_yarn)


def rope_per_layer(
    cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each layer's (cos, sin), each (n_pos, rope_dim/2): the global layers share one pair of tables, the
    sliding-window layers another; (n_pos, 0) where positions are learned (nothing rotates)."""
    if cfg.spec.positions != "rope":
        none = np.zeros((n_pos, 0), dtype=np.float32)
        return [(none, none)] * cfg.n_layer
    tables = rope_tables(cfg, n_pos, freq_factors)
    if not any(cfg.local):
        return [tables] * cfg.n_layer
    local = rope_tables(cfg, n_pos, freq_factors, local=True)
    return [local if is_local else tables for is_local in cfg.local]


def layer_specs(
    cfg: ModelConfig, weights: Weights, rope: list[tuple[np.ndarray, np.ndarray]], n_layers: int | None = None
) -> list[LayerSpec]:
    """The first n_layers layers (default: all) as LayerSpecs; rope: each layer's tables (`rope_per_layer`)."""
    family, eps = cfg.spec, cfg.norm_eps
    rope_dim = cfg.rope_dim if family.positions == "rope" else 0

    def norm(w: np.ndarray, b: np.ndarray | None = None) -> Norm:
        return Norm(family.norm, w, b, eps)

    def rms(w: np.ndarray | None) -> Norm | None:  # q/k norms and post-norms are RMSNorms in every family
        return None if w is None else Norm("rms", w, None, eps)

    specs = []
    for li, lw in enumerate(weights.layers[: cfg.n_layer if n_layers is None else n_layers]):
        bq, bk, bv = lw.bqkv or (None, None, None)
        wq, wk, wv = lw.wqkv
        attention = Attention(
            n_head=cfg.n_head,
            n_kv=cfg.n_kv_head,
            head_dim=cfg.head_dim,
            q=Linear(wq, bq),
            k=Linear(wk, bk),
            v=Linear(wv, bv),
            q_norm=rms(lw.q_norm),
            k_norm=rms(lw.k_norm),
            rope=Rope(rope_dim, family.rope_neox, *rope[li]),
            scale=cfg.attn_scale,
            softcap=cfg.attn_softcap,
            window=cfg.window(li),
            out=Linear(lw.wo, lw.bo),
        )
        gate = Linear(lw.w_gate, None) if lw.w_gate is not None else None
        ffn: Ffn = lw.moe or DenseFfn(family.ffn, gate, Linear(lw.w_up, lw.b_up), Linear(lw.w_down, lw.b_down))
        specs.append(
            LayerSpec(
                index=li,
                attn_norm=norm(lw.attn_norm, lw.attn_norm_b),
                attention=attention,
                attn_post_norm=rms(lw.post_attn_norm),
                ffn_norm=norm(lw.ffn_norm, lw.ffn_norm_b),
                ffn=ffn,
                ffn_post_norm=rms(lw.post_ffn_norm),
                residual_scale=cfg.residual_scale,
            )
        )
    return specs


def output_norm(cfg: ModelConfig, weights: Weights) -> Norm:
    """The norm before the output head."""
    return Norm(cfg.spec.norm, weights.output_norm, weights.output_norm_b, cfg.norm_eps)


P = TypeVar("P")


def on_device(
    parts: list[P],
    vector: Callable[[np.ndarray], Array],
    matrix: Callable[[WeightMatrix], Matrix],
    experts: Callable[[ExpertTensor], Any],
) -> list[P]:
    """Copies of specs (or of their parts: a Norm) with every array passed through `vector`, every weight
    through `matrix` and every 3-D expert tensor through `experts`: a device's copy. An array that several layers
    share (the RoPE tables) is converted once."""
    done: dict[int, Any] = {}

    def convert(value: Any) -> Any:
        if isinstance(value, np.ndarray | WeightMatrix | ExpertTensor):
            if id(value) not in done:
                make: Callable[[Any], Any] = experts if isinstance(value, ExpertTensor) else matrix
                done[id(value)] = vector(value) if isinstance(value, np.ndarray) else make(value)
            return done[id(value)]
        if isinstance(value, tuple):  # a router FFN's shared expert
            return tuple(convert(v) for v in value)
        if is_dataclass(value) and not isinstance(value, type):
            return replace(value, **{f.name: convert(getattr(value, f.name)) for f in fields(value)})
        return value

    return [convert(part) for part in parts]
