"""One token through a whole layer in one compiled call (decode.layer), fed from the layer's LayerSpec.

`decode_args` is the one place a spec becomes the kernel's arguments: a namedtuple whose fields are the kernel's
own parameter names, filled by keyword, so an argument cannot land in another's place unnoticed.
"""

from __future__ import annotations

import inspect
from collections import namedtuple
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import get_num_threads

from ..formats import bf16, f16
from ..layer import DenseFfn
from . import PACKED_TYPES, PARALLEL_MIN_BYTES, WeightMatrix, attention, decode

if TYPE_CHECKING:
    from ..layer import LayerSpec, Linear, Norm

_HALF_TYPES = (f16.TYPE, bf16.TYPE)
_NONE = np.zeros(0, dtype=np.float32)  # an absent norm or bias, as the kernel takes it
# decode.layer's parameters: those of each call, then the layer's own (DecodeArgs).
_CALL = ("x", "pos", "kc", "vc", "cos", "sin", "threads")
_PARAMS = tuple(inspect.signature(decode.layer.py_func).parameters)
if _PARAMS[: len(_CALL)] != _CALL:
    raise ImportError(f"decode.layer's parameters begin {_PARAMS[: len(_CALL)]}, expected {_CALL}")
DecodeArgs = namedtuple("DecodeArgs", _PARAMS[len(_CALL) :])  # type: ignore[misc]  # fields: decode.layer's


def _weight(w: WeightMatrix) -> tuple[Any, ...]:
    """W as decode.layer takes it: (q, s, format tag: formats.dispatch.tag) when packed, (bit patterns, bf16)
    for 16-bit floats."""
    if w.ggml_type in _HALF_TYPES:
        return w.data, w.ggml_type == bf16.TYPE
    p = w.prepare().packed
    return p.q, p.s, p.fmt


def _vector(a: np.ndarray | None) -> np.ndarray:
    return _NONE if a is None else np.ascontiguousarray(a, dtype=np.float32)


def _norm(n: Norm | None) -> np.ndarray:
    return _vector(None if n is None else n.weight)


def _bias(lin: Linear) -> np.ndarray:
    return _vector(lin.b)


def decode_args(spec: LayerSpec) -> DecodeArgs:
    """The kernel's arguments for one layer (DecodeLayer.fits(spec) must hold)."""
    att, ffn = spec.attention, spec.ffn
    return DecodeArgs(
        attn_norm=_norm(spec.attn_norm),
        attn_norm_b=_vector(spec.attn_norm.bias),
        q_norm=_norm(att.q_norm),
        k_norm=_norm(att.k_norm),
        attn_post_norm=_norm(spec.attn_post_norm),
        ffn_norm=_norm(spec.ffn_norm),
        ffn_norm_b=_vector(spec.ffn_norm.bias),
        ffn_post_norm=_norm(spec.ffn_post_norm),
        wq=_weight(att.q.w),
        bq=_bias(att.q),
        wk=_weight(att.k.w),
        bk=_bias(att.k),
        wv=_weight(att.v.w),
        bv=_bias(att.v),
        wo=_weight(att.out.w),
        bo=_bias(att.out),
        w_gate=_weight(ffn.gate.w if ffn.gate is not None else ffn.up.w),  # unused without a gate
        w_up=_weight(ffn.up.w),
        b_up=_bias(ffn.up),
        w_down=_weight(ffn.down.w),
        b_down=_bias(ffn.down),
        n_head=att.n_head,
        n_kv=att.n_kv,
        head_dim=att.head_dim,
        rope_dim=att.rope.dim,
        neox=int(att.rope.neox),
        d_ff=ffn.down.w.cols,
        ffn_kind=decode.FFN_KINDS[ffn.activation],
        layer_norm_kind=int(spec.attn_norm.kind == "layer"),
        window=att.window,
        eps=float(spec.attn_norm.eps),
        attn_scale=float(att.scale),
        softcap=float(att.softcap),
        gelu=attention.gelu_table(),  # GeGLU's table (float32 (65536,))
        parallel_min_bytes=PARALLEL_MIN_BYTES,
    )


class DecodeLayer:
    """One layer's one-token step: decode.layer with the arguments `decode_args` built from its spec.

    Built only for a spec the kernel runs (`fits`): every product with a packed or 16-bit float kernel, and the
    layer's shape one the kernel knows. The forward pass takes the per-op path otherwise, and whenever
    `float_products()` is in force.
    """

    def __init__(self, spec: LayerSpec):
        self.args = decode_args(spec)
        self._cos, self._sin = spec.attention.rope.cos, spec.attention.rope.sin  # (n_pos, rope_dim/2)

    @staticmethod
    def fits(spec: LayerSpec) -> bool:
        att, ffn, norms = spec.attention, spec.ffn, spec.norms()
        inner = [n for n in (att.q_norm, att.k_norm, spec.attn_post_norm, spec.ffn_post_norm) if n is not None]
        return (
            products_fit(spec.matrices())
            and isinstance(ffn, DenseFfn)
            and ffn.activation in decode.FFN_KINDS
            and (ffn.gate is None) == (ffn.activation == "gelu")
            and (ffn.gate is None or ffn.gate.b is None)
            and spec.attn_norm.kind == spec.ffn_norm.kind
            and spec.attn_norm.kind in ("rms", "layer")
            and all(n.kind == "rms" for n in inner)  # q/k and post-norms: RMSNorms in the kernel
            and spec.residual_scale == 1.0
            and all(n.weight.shape[0] == att.head_dim for n in (att.q_norm, att.k_norm) if n is not None)  # per head
            and all(n.eps == spec.attn_norm.eps for n in norms)  # one eps for every norm
        )

    def __call__(self, x: np.ndarray, pos: int, kc: np.ndarray, vc: np.ndarray) -> None:
        """x (d,) float32 in place, at position pos; kc, vc (n_kv, rows, width): the layer's cache as the kernels
        take it (cache_types.cache_bits: KVCache.kernel_views)."""
        decode.layer(x, pos, kc, vc, self._cos, self._sin, get_num_threads(), *self.args)


def products_fit(weights: Sequence[WeightMatrix | None]) -> bool:
    """Every weight has a one-token kernel: packed, or 16-bit floats."""
    return all(w is None or w.ggml_type in PACKED_TYPES or w.ggml_type in _HALF_TYPES for w in weights)
