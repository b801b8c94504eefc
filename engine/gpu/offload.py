"""The offload: layers [0, n_layers) and optionally the output head on a device (engine.model.Offload).

The layers run engine/layer.py's `run_layer`, as the CPU's do, over the same LayerSpecs uploaded to the device,
with DeviceOps: each op on arrays of `backend.xp` (engine/gpu/ops.py), the KV cache device-resident.
Activations cross from and to the CPU as NumPy arrays (t × d floats per call); weights and the cache stay on
the device. A mixture-of-experts layer's router logits cross too, (t, n_expert) floats: the experts are chosen
on the host by the CPU's own `route`, and only those are dequantized and multiplied on the device.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from .. import cache_types
from ..cache_types import row_layout
from ..config import ModelConfig
from ..kernels import WeightMatrix
from ..layer import (
    Attention,
    DenseFfn,
    LayerSpec,
    Linear,
    Norm,
    layer_specs,
    on_device,
    output_norm,
    rope_per_layer,
    run_layer,
)
from ..moe import ExpertTensor, RouterFfn, by_expert, route
from ..weights import Weights
from . import ops
from .backend import Backend, DeviceError
from .matrix import DeviceExperts, DeviceMatrix, matmul

Array = Any  # an xp.ndarray


class DeviceCache:
    """Keys and values of the offloaded layers for n_ctx positions on the device, each stored as its cache type
    (engine/cache_types.py): float16, or q8_0 blocks (bytes).

    The CPU engine rounds keys and values to float16 before it caches them (as llama.cpp's F16 cache does),
    so storing halves keeps exactly the same values in half the memory; q8_0 rows are quantized as the CPU's.
    """

    def __init__(
        self, backend: Backend, cfg: ModelConfig, n_layers: int, n_ctx: int, type_k: str = "f16", type_v: str = "f16"
    ):
        xp = backend.xp
        rows = [cfg.cache_rows(li, n_ctx) for li in range(n_layers)]
        (dtype_k, width_k), (dtype_v, width_v) = row_layout(type_k, cfg.head_dim), row_layout(type_v, cfg.head_dim)
        self.k = [xp.zeros((cfg.n_kv_head, r, width_k), dtype=dtype_k) for r in rows]  # per layer (kv head, row, width)
        self.v = [xp.zeros((cfg.n_kv_head, r, width_v), dtype=dtype_v) for r in rows]
        self.type_k, self.type_v = type_k, type_v
        self.n_ctx = n_ctx

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v))


def cache_bytes(cfg: ModelConfig, n_layers: int, n_ctx: int) -> int:
    """Device memory of one DeviceCache of the largest type (f16)."""
    return 2 * 2 * cfg.n_kv_head * cfg.head_dim * sum(cfg.cache_rows(li, n_ctx) for li in range(n_layers))


class DeviceOffload:
    """engine.model.Offload on a Backend: weights uploaded once, here; one DeviceCache per session."""

    def __init__(
        self, backend: Backend, cfg: ModelConfig, weights: Weights, n_layers: int, runs_output: bool, n_ctx: int
    ):
        if not 0 < n_layers <= cfg.n_layer or (runs_output and n_layers != cfg.n_layer):
            raise ValueError(f"cannot offload {n_layers} of {cfg.n_layer} layers (output: {runs_output})")
        self.backend = backend
        self.cfg = cfg
        self.n_layers = n_layers
        self.runs_output = runs_output
        xp = backend.xp
        specs = layer_specs(cfg, weights, rope_per_layer(cfg, max(n_ctx, 1), weights.rope_freqs), n_layers)
        self._check_memory(specs, weights, n_ctx)

        def upload(w: WeightMatrix) -> DeviceMatrix:
            return DeviceMatrix.upload(xp, w)

        def upload_experts(t: ExpertTensor) -> DeviceExperts:
            return DeviceExperts.upload(xp, t)

        # the LayerSpecs, arrays and weights on the device
        self.layers = on_device(specs, xp.asarray, upload, upload_experts)
        norm_out = on_device([output_norm(cfg, weights)], xp.asarray, upload, upload_experts) if runs_output else None
        self.output_norm = norm_out[0] if norm_out else None
        self.output_w = DeviceMatrix.upload(xp, weights.output) if runs_output else None

    # -- set-up --------------------------------------------------------------------------------------------

    def _check_memory(self, specs: list[LayerSpec], weights: Weights, n_ctx: int) -> None:
        free = self.backend.free_bytes()
        if free is None:
            return
        mats = [m for spec in specs for m in (*spec.matrices(), *experts(spec))]
        if self.runs_output:
            mats.append(weights.output)
        need = sum(m.data.nbytes for m in mats) + cache_bytes(self.cfg, self.n_layers, n_ctx)
        if need > free:
            raise DeviceError(
                f"{self.n_layers} layers{' and the output' if self.runs_output else ''} with a context of {n_ctx} "
                f"need {need / 2**30:.1f} GiB on {self.backend.label}, {free / 2**30:.1f} GiB is free "
                f"(offload fewer layers or use a smaller context)"
            )

    @property
    def nbytes(self) -> int:
        """Device memory held by the weights."""
        mats = [m for spec in self.layers for m in (*spec.matrices(), *experts(spec))]
        if self.output_w is not None:
            mats.append(self.output_w)
        return sum(m.nbytes for m in mats)

    # -- the Offload protocol ------------------------------------------------------------------------------

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> DeviceCache:
        return DeviceCache(self.backend, self.cfg, self.n_layers, n_ctx, type_k, type_v)

    def forward_layers(self, x: np.ndarray, cache: DeviceCache, start: int) -> np.ndarray:
        """x (t, d) float32 at positions start.. through the offloaded layers -> (t, d) float32."""
        xp = self.backend.xp
        end = start + x.shape[0]
        if end > cache.n_ctx:
            raise ValueError(f"positions up to {end} do not fit a device cache of {cache.n_ctx}")
        x = xp.array(x, dtype=xp.float32)  # (t, d), a copy: the caller's array is never written
        device_ops = DeviceOps(xp, cache, start)
        for layer in self.layers:
            x = run_layer(device_ops, layer, x)
        return self.backend.to_host(x)

    def output(self, x: np.ndarray) -> np.ndarray:
        """Final norm and output head: x (t, d) -> logits (t, n_vocab) float32."""
        if self.output_w is None or self.output_norm is None:
            raise ValueError("the output head is not offloaded")
        xp = self.backend.xp
        h = norm(xp, xp.asarray(x, dtype=xp.float32), self.output_norm)  # (t, d)
        logits = matmul(xp, self.output_w, h)  # (t, n_vocab)
        if self.cfg.logit_scale != 1.0:
            logits = logits / self.cfg.logit_scale
        if self.cfg.final_softcap:
            logits = ops.soft_cap(xp, logits, self.cfg.final_softcap)
        return self.backend.to_host(logits)


def experts(spec: LayerSpec) -> list[Any]:
    """A mixture-of-experts layer's 3-D expert tensors, host's or device's (every expert is uploaded)."""
    ffn = spec.ffn
    return [ffn.gate, ffn.up, ffn.down] if isinstance(ffn, RouterFfn) else []


def norm(xp: Any, x: Array, n: Norm) -> Array:
    """x (..., n) normalized over its last axis."""
    if n.kind == "rms":
        return ops.rms_norm(xp, x, n.weight, n.eps)
    return ops.layer_norm(xp, x, n.weight, n.bias, n.eps)


class DeviceOps:
    """engine.layer.LayerOps on the device for a pass at positions start.., its KV cache `cache`; q, k and v
    travel as (t, heads, head_dim)."""

    def __init__(self, xp: Any, cache: DeviceCache, start: int):
        self.xp, self.cache, self.start = xp, cache, start

    def _linear(self, lin: Linear, h: Array) -> Array:
        y = matmul(self.xp, lin.w, h)
        if lin.b is not None:
            y += lin.b
        return y

    def norm(self, x: Array, n: Norm) -> Array:
        return norm(self.xp, x, n)

    def post_norm(self, y: Array, n: Norm) -> Array:
        return norm(self.xp, y, n)

    def qkv(self, h: Array, att: Attention) -> tuple[Array, Array, Array]:
        t, hd = h.shape[0], att.head_dim
        q = self._linear(att.q, h).reshape(t, att.n_head, hd)  # (t, n_head, hd)
        k = self._linear(att.k, h).reshape(t, att.n_kv, hd)  # (t, n_kv, hd)
        v = self._linear(att.v, h).reshape(t, att.n_kv, hd)
        return q, k, v

    def head_norm(self, y: Array, n: Norm) -> Array:
        t, heads, hd = y.shape  # per head, or per row where the norm spans every head (olmoe)
        return norm(self.xp, y.reshape(t, -1, n.weight.shape[0]), n).reshape(t, heads, hd)

    def rope_and_store(self, q: Array, k: Array, v: Array, layer: LayerSpec) -> Array:
        xp, rope = self.xp, layer.attention.rope
        start, end = self.start, self.start + q.shape[0]
        if rope.dim:
            cos, sin = rope.cos[start:end], rope.sin[start:end]  # (t, rope_dim/2)
            q = ops.apply_rope(xp, q, cos, sin, rope.dim, rope.neox)
            k = ops.apply_rope(xp, k, cos, sin, rope.dim, rope.neox)
        # Storing rounds k and v to halves (or q8_0 blocks), as the CPU does; a ring keeps row p % rows.
        kc, vc = self.cache.k[layer.index], self.cache.v[layer.index]  # (n_kv, rows, width)
        rows = xp.arange(start, end) % kc.shape[1]
        kc[:, rows] = cache_types.to_cache(xp, k.transpose(1, 0, 2), self.cache.type_k)  # (n_kv, t, width)
        vc[:, rows] = cache_types.to_cache(xp, v.transpose(1, 0, 2), self.cache.type_v)
        return ops.half_round(xp, q)

    def attend(self, q: Array, layer: LayerSpec) -> Array:
        xp, att = self.xp, layer.attention
        start, end = self.start, self.start + q.shape[0]
        kc, vc = self.cache.k[layer.index], self.cache.v[layer.index]
        lo = max(0, start - att.window + 1) if att.window else 0  # the oldest key these queries see
        read = xp.arange(lo, end) % kc.shape[1]  # rows of positions lo..end-1, in order
        keys = cache_types.to_floats(xp, kc[:, read])  # (n_kv, end - lo, hd)
        values = cache_types.to_floats(xp, vc[:, read])
        return ops.attention(xp, q, keys, values, start, lo, att.scale, att.window, att.softcap)  # (t, n_head·hd)

    def attn_out(self, a: Array, att: Attention) -> Array:
        return self._linear(att.out, a)  # (t, d)

    def dense_ffn(self, h: Array, ffn: DenseFfn) -> Array:
        xp = self.xp
        if ffn.gate is None:
            act = ops.gelu(xp, self._linear(ffn.up, h))  # (t, d_ff)
        elif ffn.activation == "swiglu":
            act = ops.silu(xp, self._linear(ffn.gate, h)) * self._linear(ffn.up, h)
        else:
            act = ops.geglu(xp, self._linear(ffn.gate, h), self._linear(ffn.up, h))
        return self._linear(ffn.down, act)  # (t, d)

    def router_ffn(self, h: Array, ffn: RouterFfn) -> Array:
        """engine/moe.py's router_ffn on the device: the router's logits (t, n_expert) go to the host, where the
        CPU's `route` chooses (so both paths choose alike) and `by_expert` groups the tokens; each chosen expert
        is then dequantized from its slice of the 3-D tensors once and multiplied with all its tokens at once."""
        xp = self.xp
        # `on_device` gave the RouterFfn its device forms of the CPU's matrices
        router = cast(DeviceMatrix, ffn.router)
        gate_e, up_e, down_e = (cast(DeviceExperts, m) for m in (ffn.gate, ffn.up, ffn.down))
        logits = matmul(xp, router, h)  # (t, n_expert)
        ids, weights = route(logits if xp is np else xp.asnumpy(logits), ffn.n_used, ffn.norm_weights)  # (t, k)
        groups = by_expert(ids)
        # Every group's tokens and weights, one after the other, in one upload each: (t·k,) and (t·k, 1)
        tokens = xp.asarray(np.concatenate([g[1] for g in groups]))
        w = xp.asarray(weights.ravel()[np.concatenate([g[2] for g in groups])][:, None])
        out = xp.zeros((h.shape[0], down_e.rows), dtype=xp.float32)  # (t, d)
        s0 = 0
        for e, chosen_by, _slots in groups:
            s1 = s0 + len(chosen_by)
            rows = tokens[s0:s1]  # (n_e,)
            xe = h[rows]  # (n_e, d)
            act = ops.silu(xp, matmul(xp, gate_e.expert(e), xe)) * matmul(xp, up_e.expert(e), xe)  # (n_e, d_ff)
            out[rows] += w[s0:s1] * matmul(xp, down_e.expert(e), act)  # (n_e, d)
            s0 = s1
        if ffn.shared is not None:
            shared = cast(tuple[DeviceMatrix, DeviceMatrix, DeviceMatrix, DeviceMatrix | None], ffn.shared)
            gate, up, down, gate_inp = shared
            y = matmul(xp, down, ops.silu(xp, matmul(xp, gate, h)) * matmul(xp, up, h))  # (t, d)
            if gate_inp is not None:  # qwen2moe's sigmoid gate; Granite's shared expert has none
                y *= 1.0 / (1.0 + xp.exp(-matmul(xp, gate_inp, h)))  # (t, 1)
            out += y
        return out

    def residual(self, x: Array, y: Array, scale: float = 1.0) -> Array:
        if scale != 1.0:
            y *= scale  # y is a branch's output, no longer needed
        x += y
        return x
