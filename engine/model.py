"""The forward pass: one function for every architecture, reading the ArchSpec.

embed -> per layer (norm -> attention with KV cache -> residual -> norm -> FFN -> residual) -> norm -> logits.
Quantized products go through engine.kernels; everything else is float32 NumPy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .config import ModelConfig
from .errors import EngineError, SettingsError
from .gguf_file import GGUFFile
from .kernels import (
    DecodeLayer,
    causal_attention,
    embedding_rows,
    float_products_active,
    matmul,
    rms_norm_rows,
    rope_into_cache,
    swiglu,
)
from .weights import LayerWeights, Weights

if TYPE_CHECKING:
    from .tokenizer import StreamDecoder, Tokenizer

# Prompts are evaluated in chunks of this many tokens to bound scratch memory (scores are heads × chunk × ctx).
PREFILL_CHUNK = 256


class ContextFullError(EngineError):
    """More tokens than the session's context holds."""


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x (t, d) -> (t, d). The NumPy statement (the GPU path's reference); the CPU pass runs kernels.rms_norm_rows.
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    # x (t, d) -> (t, d)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    return xc * (1.0 / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)) * w + b


def half_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest float16 value, kept as float32."""
    return x.astype(np.float16).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu(x: np.ndarray) -> np.ndarray:
    # The tanh approximation, as GPT-2 and ggml use.
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608) * (x + np.float32(0.044715) * x * x * x)))


def rope_tables(cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position's rotation angles: each (n_pos, rope_dim/2) float32."""
    half = cfg.rope_dim // 2
    inv_freq = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    angles = np.outer(np.arange(n_pos, dtype=np.float64) * cfg.rope_scale, inv_freq)  # (n_pos, half)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


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


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal attention of t new queries over T = start + t cached positions: the NumPy statement of what
    kernels.causal_attention computes (and the reference the tests hold it to).

    q (t, n_head, hd); k, v (n_kv, T, hd) -> (t, n_head·hd). Query head h reads kv head h // (n_head/n_kv).
    """
    t, n_head, hd = q.shape
    n_kv, n_pos, _ = k.shape
    group = n_head // n_kv
    qg = q.transpose(1, 0, 2).reshape(n_kv, group * t, hd)  # (n_kv, group·t, hd)
    scores = np.matmul(qg, k.transpose(0, 2, 1))  # (n_kv, group·t, T)
    scores *= np.float32(1.0 / np.sqrt(hd))
    if t > 1:
        scores = scores.reshape(n_kv, group, t, n_pos)
        future = np.triu(np.ones((t, n_pos), dtype=bool), k=start + 1)  # query i sees keys <= start + i
        scores[:, :, future] = -np.inf
        scores = scores.reshape(n_kv, group * t, n_pos)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v)  # (n_kv, group·t, hd)
    return out.reshape(n_head, t, hd).transpose(1, 0, 2).reshape(t, n_head * hd)


def split_qkv(cfg: ModelConfig, outs: list) -> tuple:
    """The q/k/v projections' outputs, (q, k, v) or one fused (t, q_dim + 2·kv_dim), as per-head arrays:
    (t, n_head, hd), (t, n_kv, hd), (t, n_kv, hd). Works on NumPy and CuPy arrays alike."""
    if len(outs) == 1:  # fused attn_qkv: rows are [q; k; v]
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        fused = outs[0]
        outs = [fused[:, :q_dim], fused[:, q_dim : q_dim + kv_dim], fused[:, q_dim + kv_dim :]]
    q, k, v = outs
    t = q.shape[0]
    return (
        q.reshape(t, cfg.n_head, cfg.head_dim),
        k.reshape(t, cfg.n_kv_head, cfg.head_dim),
        v.reshape(t, cfg.n_kv_head, cfg.head_dim),
    )


class Offload(Protocol):
    """Layers [0, n_layers) -- and the output head when `runs_output` -- run on another device (engine.gpu).

    Their KV cache lives on that device, in the object `new_cache` returns; activations cross as NumPy arrays.
    """

    n_layers: int
    runs_output: bool

    def new_cache(self, n_ctx: int) -> object: ...

    def forward_layers(self, x: np.ndarray, cache: object, start: int) -> np.ndarray:
        """x (t, d) float32 at positions start.. through the offloaded layers -> (t, d) float32."""
        ...

    def output(self, x: np.ndarray) -> np.ndarray:
        """Final norm and output head: x (t, d) -> logits (t, n_vocab) float32."""
        ...


class KVCache:
    """Keys and values for n_ctx positions, allocated once: the CPU layers' here, the offloaded layers' in
    `device` (None without offload). Stored as float16, as llama.cpp's default cache: the forward pass rounds
    k and v to float16 anyway, so the cache is exact at half the memory of float32."""

    def __init__(self, cfg: ModelConfig, n_ctx: int, offload: Offload | None = None):
        first = offload.n_layers if offload is not None else 0
        # (layer - first, kv head, position, hd)
        shape = (cfg.n_layer - first, cfg.n_kv_head, n_ctx, cfg.head_dim)
        self.k = np.zeros(shape, dtype=np.float16)
        self.v = np.zeros(shape, dtype=np.float16)
        self.device = offload.new_cache(n_ctx) if offload is not None else None
        self.n_ctx = n_ctx

    @property
    def nbytes(self) -> int:
        """Bytes of the CPU part."""
        return self.k.nbytes + self.v.nbytes


@dataclass(frozen=True)
class LoadInfo:
    load_s: float  # wall time of load_model
    warnings: tuple[str, ...]


class Model:
    """A loaded model: weights mapped from the file, tokenizer, and the forward pass."""

    def __init__(
        self,
        file: GGUFFile,
        cfg: ModelConfig,
        weights: Weights,
        tokenizer: Tokenizer,
        n_ctx: int,
        threads: int,
    ):
        self.file = file
        self.cfg = cfg
        self.weights = weights
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.threads = threads
        self.warnings: list[str] = []
        self.load_s = 0.0
        self.offload: Offload | None = None  # set by load_model for --device cuda / --gpu-layers
        self.device = "cpu"  # where the layers run, for display (load_model says more when offloading)
        n_pos = max(n_ctx, 1)
        if cfg.spec.positions == "rope":
            self._cos, self._sin = rope_tables(cfg, n_pos, weights.rope_freqs)
            self._rope_shape = (cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope_dim, cfg.spec.rope_neox)
        self.fused_decode = True  # single tokens take the one-call path (kernels.decode); False: the reference
        self._decode_layers: list[DecodeLayer | None] | None | bool = False  # False: not built yet (see _fast_layers)
        # The kernels use every core; two threads entering at once would oversubscribe them (and Numba's
        # workqueue layer aborts on it). One forward pass at a time, whoever calls.
        self._lock = threading.Lock()

    # -- text ------------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self.cfg.n_vocab

    @property
    def name(self) -> str:
        return str(self.file.metadata.get("general.name") or self.file.path.stem)

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.tokenize(text, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(ids)

    def stream_decoder(self) -> StreamDecoder:
        return self.tokenizer.stream_decoder()

    # -- compute ---------------------------------------------------------------------------------------

    def session(self, n_ctx: int | None = None) -> Session:
        """A fresh KV cache of n_ctx positions (default and maximum: the model's n_ctx)."""
        if n_ctx is not None and not 0 < n_ctx <= self.n_ctx:
            raise SettingsError(f"session context {n_ctx} must be between 1 and the model's {self.n_ctx}")
        return Session(self, n_ctx or self.n_ctx)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of `ids` in a fresh context: float32 (len(ids), n_vocab)."""
        ids = self._check_ids(ids)
        if len(ids) > self.n_ctx:
            raise ContextFullError(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        cache = KVCache(self.cfg, len(ids), self.offload)
        parts = [
            self.forward(ids[i : i + PREFILL_CHUNK], cache, i, last_only=False)
            for i in range(0, len(ids), PREFILL_CHUNK)
        ]
        return np.concatenate(parts, axis=0)

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise ValueError("no tokens to evaluate")
        if arr.min() < 0 or arr.max() >= self.cfg.n_vocab:
            raise ValueError(f"token id out of range [0, {self.cfg.n_vocab})")
        return arr

    def forward(self, ids: np.ndarray, cache: KVCache, start: int, last_only: bool) -> np.ndarray:
        """Run ids at positions start.. through the model, writing their K/V into cache.

        Returns logits (1, n_vocab) for the last token when last_only, else (t, n_vocab).
        """
        with self._lock:
            return self._forward(ids, cache, start, last_only)

    def _forward(self, ids: np.ndarray, cache: KVCache, start: int, last_only: bool) -> np.ndarray:
        cfg, w = self.cfg, self.weights
        t = len(ids)
        end = start + t
        x = embedding_rows(w.token_embd, ids)  # (t, d)
        if w.position_embd is not None:
            x += w.position_embd[start:end]
        first = 0
        if self.offload is not None:
            x = self.offload.forward_layers(x, cache.device, start)
            first = self.offload.n_layers
        fast = self._fast_layers() if t == 1 else None
        for li in range(first, cfg.n_layer):
            ci = li - first  # the layer's index in the CPU cache
            if fast is not None:  # one token: the whole layer in one compiled call, same arithmetic as below
                fast[li](x[0], start, cache.k[ci], cache.v[ci], self._cos[start], self._sin[start])
                continue
            lw = w.layers[li]
            h = self._norm(x, lw.attn_norm, lw.attn_norm_b)
            q, k, v = self._qkv(h, lw)  # (t, n_head, hd), (t, n_kv, hd), (t, n_kv, hd)
            # Keys, values and queries carry half precision into attention, as llama.cpp's F16 KV cache does:
            # matching its rounding keeps near-tie tokens the same as llama.cpp picks them.
            if cfg.spec.positions == "rope":  # rotate, round q, store k and v: compiled, as the decode layer
                cos, sin = self._cos[start:end], self._sin[start:end]
                rows = [np.ascontiguousarray(a.reshape(t, -1)) for a in (q, k, v)]  # (t, heads·hd) each
                rope_into_cache(*rows, cache.k[ci], cache.v[ci], start, cos, sin, self._rope_shape)
                q = rows[0].reshape(q.shape)  # rotated and rounded in place
            else:
                cache.k[ci, :, start:end] = k.transpose(1, 0, 2)  # (n_kv, t, hd), rounded to float16
                cache.v[ci, :, start:end] = v.transpose(1, 0, 2)
                q = half_round(q)
            a = causal_attention(q, cache.k[ci], cache.v[ci], start)  # (t, n_head·hd)
            x += self._bias(matmul(lw.wo, a), lw.bo)
            h = self._norm(x, lw.ffn_norm, lw.ffn_norm_b)
            if lw.w_gate is not None:
                h = swiglu(matmul(lw.w_gate, h), matmul(lw.w_up, h))  # (t, d_ff): silu(gate) * up
            else:
                h = gelu(self._bias(matmul(lw.w_up, h), lw.b_up))
            x += self._bias(matmul(lw.w_down, h), lw.b_down)
        if last_only:
            x = x[-1:]
        if self.offload is not None and self.offload.runs_output:
            return self.offload.output(x)
        x = self._norm(x, w.output_norm, w.output_norm_b)
        return matmul(w.output, x)  # (t, n_vocab)

    def _fast_layers(self) -> list[DecodeLayer | None] | None:
        """Every layer's one-call decode arguments, when the architecture and weight types allow it."""
        if not self.fused_decode or float_products_active():
            return None
        if self._decode_layers is False:
            self._decode_layers = self._build_decode_layers()
        return self._decode_layers

    def _build_decode_layers(self) -> list[DecodeLayer | None] | None:
        cfg, spec = self.cfg, self.cfg.spec
        if spec.norm != "rms" or spec.positions != "rope":
            return None
        first = self.offload.n_layers if self.offload is not None else 0
        layers: list[DecodeLayer | None] = [None] * first  # offloaded layers: never run here, never packed
        for lw in self.weights.layers[first:]:
            if lw.w_gate is None or len(lw.wqkv) != 3 or lw.bo is not None or lw.b_up is not None:
                return None
            if lw.b_down is not None or not DecodeLayer.fits((*lw.wqkv, lw.wo, lw.w_gate, lw.w_up, lw.w_down)):
                return None
            shape = (cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope_dim, spec.rope_neox)
            layers.append(
                DecodeLayer(
                    (lw.attn_norm, lw.ffn_norm),
                    lw.wqkv,
                    lw.wo,
                    (lw.w_gate, lw.w_up, lw.w_down),
                    lw.bqkv,
                    shape,
                    cfg.norm_eps,
                )  # fmt: skip
            )
        return layers

    def _norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        if self.cfg.spec.norm == "rms":
            return rms_norm_rows(x, weight, self.cfg.norm_eps)
        return layer_norm(x, weight, bias, self.cfg.norm_eps)

    @staticmethod
    def _bias(y: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        if b is not None:
            y += b
        return y

    def _qkv(self, h: np.ndarray, lw: LayerWeights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        biases = lw.bqkv or (None,) * len(lw.wqkv)
        return split_qkv(self.cfg, [self._bias(matmul(m, h), b) for m, b in zip(lw.wqkv, biases, strict=True)])


class Session:
    """A conversation's state on one model: a KV cache of n_ctx positions and the token ids it holds."""

    def __init__(self, model: Model, n_ctx: int):
        self.model = model
        self.cache = KVCache(model.cfg, n_ctx, model.offload)
        self.tokens: list[int] = []  # ids whose K/V are in the cache, in order

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def n_ctx(self) -> int:
        return self.cache.n_ctx

    def eval(self, ids: Sequence[int], on_chunk: Callable[[int], None] | None = None) -> np.ndarray:
        """Append ids to the cache; return float32 (n_vocab,) logits for the last one."""
        arr = self.model._check_ids(ids)
        if self.n_past + len(arr) > self.n_ctx:
            raise ContextFullError(f"{self.n_past} cached + {len(arr)} new tokens exceed the context of {self.n_ctx}")
        logits = None
        for i in range(0, len(arr), PREFILL_CHUNK):
            chunk = arr[i : i + PREFILL_CHUNK]
            logits = self.model.forward(chunk, self.cache, self.n_past, last_only=True)
            self.tokens.extend(int(t) for t in chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
        return logits[0]

    def eval_all(self, ids: Sequence[int]) -> np.ndarray:
        """Append ids to the cache; return float32 (len(ids), n_vocab) logits, one row per id (draft checks)."""
        arr = self.model._check_ids(ids)
        if self.n_past + len(arr) > self.n_ctx:
            raise ContextFullError(f"{self.n_past} cached + {len(arr)} new tokens exceed the context of {self.n_ctx}")
        parts = []
        for i in range(0, len(arr), PREFILL_CHUNK):
            chunk = arr[i : i + PREFILL_CHUNK]
            parts.append(self.model.forward(chunk, self.cache, self.n_past, last_only=False))
            self.tokens.extend(int(t) for t in chunk)
        return np.concatenate(parts, axis=0)

    def truncate(self, n: int) -> None:
        """Forget every position from n on (their cache slots are overwritten by later evals)."""
        if not 0 <= n <= self.n_past:
            raise SettingsError(f"cannot truncate a session of {self.n_past} tokens to {n}")
        del self.tokens[n:]
