"""The offload: layers [0, n_layers) and optionally the output head on a device (engine.model.Offload).

The same per-layer forward pass as engine/model.py, top to bottom, on arrays of `backend.xp`, reading the same
config (the family's description): norm -> q, k, v [-> q/k norm] -> RoPE -> attention over the device-resident
KV cache [-> post-norm] -> residual -> norm -> FFN [-> post-norm] -> residual. Activations cross from and to the
CPU as NumPy arrays (t × d floats per call); weights and the cache stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..model import rope_tables
from ..weights import LayerWeights, Weights
from . import ops
from .backend import Backend, DeviceError
from .matrix import DeviceMatrix, matmul

Array = Any  # an xp.ndarray


@dataclass(frozen=True)
class DeviceLayer:
    """One block's weights on the device; fields as engine.weights.LayerWeights."""

    attn_norm: Array  # (d,)
    attn_norm_b: Array | None
    wqkv: tuple[DeviceMatrix, DeviceMatrix, DeviceMatrix]  # wq, wk, wv
    bqkv: tuple[Array, Array, Array] | None
    q_norm: Array | None  # (head_dim,)
    k_norm: Array | None
    post_attn_norm: Array | None  # (d,)
    post_ffn_norm: Array | None
    wo: DeviceMatrix  # (d, n_head·head_dim)
    bo: Array | None
    ffn_norm: Array
    ffn_norm_b: Array | None
    w_gate: DeviceMatrix | None  # (d_ff, d) SwiGLU only
    w_up: DeviceMatrix  # (d_ff, d)
    b_up: Array | None
    w_down: DeviceMatrix  # (d, d_ff)
    b_down: Array | None


class DeviceCache:
    """Keys and values of the offloaded layers for n_ctx positions, in float16 on the device.

    The CPU engine rounds keys and values to float16 before it caches them (as llama.cpp's F16 cache does),
    so storing halves keeps exactly the same values in half the memory.
    """

    def __init__(self, backend: Backend, cfg: ModelConfig, n_layers: int, n_ctx: int):
        xp = backend.xp
        shapes = [(cfg.n_kv_head, cfg.cache_rows(li, n_ctx), cfg.head_dim) for li in range(n_layers)]
        self.k = [xp.zeros(shape, dtype=xp.float16) for shape in shapes]  # per layer (kv head, row, hd)
        self.v = [xp.zeros(shape, dtype=xp.float16) for shape in shapes]
        self.n_ctx = n_ctx

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v))


def cache_bytes(cfg: ModelConfig, n_layers: int, n_ctx: int) -> int:
    """Device memory of one DeviceCache."""
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
        self._check_memory(weights, n_ctx)
        self.layers = tuple(self._upload_layer(lw) for lw in weights.layers[:n_layers])
        self.output_norm = xp.asarray(weights.output_norm) if runs_output else None
        self.output_norm_b = self._vector(weights.output_norm_b) if runs_output else None
        self.output_w = DeviceMatrix.upload(xp, weights.output) if runs_output else None
        self._rope: list[tuple[Array, Array] | None] = [None] * n_layers  # per layer: (cos, sin) (n_ctx, rope_dim/2)
        if cfg.spec.positions == "rope":
            tables = {}
            for li in range(n_layers):
                local = cfg.local[li] and cfg.rope_base_local != cfg.rope_base
                if local not in tables:
                    cos, sin = rope_tables(cfg, max(n_ctx, 1), weights.rope_freqs, local=local)
                    tables[local] = (xp.asarray(cos), xp.asarray(sin))
                self._rope[li] = tables[local]

    # -- set-up --------------------------------------------------------------------------------------------

    def _check_memory(self, weights: Weights, n_ctx: int) -> None:
        free = self.backend.free_bytes()
        if free is None:
            return
        mats = [m for lw in weights.layers[: self.n_layers] for m in (*lw.wqkv, lw.wo, lw.w_gate, lw.w_up, lw.w_down)]
        if self.runs_output:
            mats.append(weights.output)
        need = sum(m.data.nbytes for m in mats if m is not None) + cache_bytes(self.cfg, self.n_layers, n_ctx)
        if need > free:
            raise DeviceError(
                f"{self.n_layers} layers{' and the output' if self.runs_output else ''} with a context of {n_ctx} "
                f"need {need / 2**30:.1f} GiB on {self.backend.label}, {free / 2**30:.1f} GiB is free "
                f"(offload fewer layers or use a smaller context)"
            )

    def _vector(self, v: np.ndarray | None) -> Array | None:
        return None if v is None else self.backend.xp.asarray(v)

    def _upload_layer(self, lw: LayerWeights) -> DeviceLayer:
        xp = self.backend.xp

        def mat(w):  # WeightMatrix | None -> DeviceMatrix | None
            return None if w is None else DeviceMatrix.upload(xp, w)

        return DeviceLayer(
            attn_norm=xp.asarray(lw.attn_norm),
            attn_norm_b=self._vector(lw.attn_norm_b),
            wqkv=tuple(mat(w) for w in lw.wqkv),
            bqkv=tuple(self._vector(b) for b in lw.bqkv) if lw.bqkv is not None else None,
            q_norm=self._vector(lw.q_norm),
            k_norm=self._vector(lw.k_norm),
            post_attn_norm=self._vector(lw.post_attn_norm),
            post_ffn_norm=self._vector(lw.post_ffn_norm),
            wo=mat(lw.wo),
            bo=self._vector(lw.bo),
            ffn_norm=xp.asarray(lw.ffn_norm),
            ffn_norm_b=self._vector(lw.ffn_norm_b),
            w_gate=mat(lw.w_gate),
            w_up=mat(lw.w_up),
            b_up=self._vector(lw.b_up),
            w_down=mat(lw.w_down),
            b_down=self._vector(lw.b_down),
        )

    @property
    def nbytes(self) -> int:
        """Device memory held by the weights."""
        mats = [m for lw in self.layers for m in (*lw.wqkv, lw.wo, lw.w_gate, lw.w_up, lw.w_down) if m is not None]
        if self.output_w is not None:
            mats.append(self.output_w)
        return sum(m.nbytes for m in mats)

    # -- the Offload protocol ------------------------------------------------------------------------------

    def new_cache(self, n_ctx: int) -> DeviceCache:
        return DeviceCache(self.backend, self.cfg, self.n_layers, n_ctx)

    def forward_layers(self, x: np.ndarray, cache: DeviceCache, start: int) -> np.ndarray:
        """x (t, d) float32 at positions start.. through the offloaded layers -> (t, d) float32."""
        xp, cfg = self.backend.xp, self.cfg
        t = x.shape[0]
        end = start + t
        if end > cache.n_ctx:
            raise ValueError(f"positions up to {end} do not fit a device cache of {cache.n_ctx}")
        x = xp.array(x, dtype=xp.float32)  # (t, d), a copy: the caller's array is never written
        hd, eps = cfg.head_dim, cfg.norm_eps
        for li, lw in enumerate(self.layers):
            h = self._norm(x, lw.attn_norm, lw.attn_norm_b)
            biases = lw.bqkv or (None, None, None)
            q, k, v = (self._bias(matmul(xp, m, h), b) for m, b in zip(lw.wqkv, biases, strict=True))
            q = q.reshape(t, cfg.n_head, hd)  # (t, n_head, hd)
            k = k.reshape(t, cfg.n_kv_head, hd)  # (t, n_kv, hd)
            v = v.reshape(t, cfg.n_kv_head, hd)
            if lw.q_norm is not None:  # per head, before RoPE
                q = ops.rms_norm(xp, q, lw.q_norm, eps)
                k = ops.rms_norm(xp, k, lw.k_norm, eps)
            if self._rope[li] is not None:
                cos, sin = (a[start:end] for a in self._rope[li])  # (t, rope_dim/2)
                q = ops.apply_rope(xp, q, cos, sin, cfg.rope_dim, cfg.spec.rope_neox)
                k = ops.apply_rope(xp, k, cos, sin, cfg.rope_dim, cfg.spec.rope_neox)
            # Storing into the float16 cache is model.py's half_round of k and v; a ring keeps row p % rows.
            kc, vc = cache.k[li], cache.v[li]  # (n_kv, rows, hd)
            window = cfg.window(li)
            lo = max(0, start - window + 1) if window else 0  # the oldest key these queries see
            store = xp.arange(start, end) % kc.shape[1]
            kc[:, store] = k.transpose(1, 0, 2)  # (n_kv, t, hd)
            vc[:, store] = v.transpose(1, 0, 2)
            read = xp.arange(lo, end) % kc.shape[1]  # rows of positions lo..end-1, in order
            keys = kc[:, read].astype(xp.float32)  # (n_kv, end - lo, hd)
            values = vc[:, read].astype(xp.float32)
            q = ops.half_round(xp, q)
            a = ops.attention(xp, q, keys, values, start, lo, cfg.attn_scale, window, cfg.attn_softcap)
            o = self._bias(matmul(xp, lw.wo, a), lw.bo)  # (t, d)
            if lw.post_attn_norm is not None:
                o = ops.rms_norm(xp, o, lw.post_attn_norm, eps)
            x += o
            h = self._norm(x, lw.ffn_norm, lw.ffn_norm_b)
            if cfg.spec.ffn == "swiglu":
                h = ops.silu(xp, matmul(xp, lw.w_gate, h)) * matmul(xp, lw.w_up, h)  # (t, d_ff)
            elif cfg.spec.ffn == "geglu":
                h = ops.geglu(xp, matmul(xp, lw.w_gate, h), matmul(xp, lw.w_up, h))  # (t, d_ff)
            else:
                h = ops.gelu(xp, self._bias(matmul(xp, lw.w_up, h), lw.b_up))
            f = self._bias(matmul(xp, lw.w_down, h), lw.b_down)  # (t, d)
            if lw.post_ffn_norm is not None:
                f = ops.rms_norm(xp, f, lw.post_ffn_norm, eps)
            x += f
        return self.backend.to_host(x)

    def output(self, x: np.ndarray) -> np.ndarray:
        """Final norm and output head: x (t, d) -> logits (t, n_vocab) float32."""
        if self.output_w is None:
            raise ValueError("the output head is not offloaded")
        xp = self.backend.xp
        h = self._norm(xp.asarray(x, dtype=xp.float32), self.output_norm, self.output_norm_b)  # (t, d)
        logits = matmul(xp, self.output_w, h)  # (t, n_vocab)
        if self.cfg.final_softcap:
            logits = ops.soft_cap(xp, logits, self.cfg.final_softcap)
        return self.backend.to_host(logits)

    # -- pieces --------------------------------------------------------------------------------------------

    def _norm(self, x: Array, weight: Array, bias: Array | None) -> Array:
        xp = self.backend.xp
        if self.cfg.spec.norm == "rms":
            return ops.rms_norm(xp, x, weight, self.cfg.norm_eps)
        return ops.layer_norm(xp, x, weight, bias, self.cfg.norm_eps)

    @staticmethod
    def _bias(y: Array, b: Array | None) -> Array:
        if b is not None:
            y += b
        return y
