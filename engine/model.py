"""The forward pass on the CPU: one function for every family, reading the model's config (the family's
description resolved against the file, engine/config.py and engine/families.py).

embed -> per layer (norm -> q, k, v [-> q/k norm] -> RoPE -> attention over the KV cache [-> post-norm] ->
residual -> norm -> FFN [-> post-norm] -> residual) -> norm -> logits [-> soft-cap].
A prompt runs each op as a compiled kernel over all its rows (engine.kernels); one token runs each layer in
one compiled call (kernels.DecodeLayer) with the same arithmetic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .config import PREFILL_CHUNK, ModelConfig
from .errors import EngineError, SettingsError
from .gguf_file import GGUFFile
from .kernels import (
    DecodeLayer,
    Scratch,
    WeightMatrix,
    causal_attention,
    decode,
    embedding_rows,
    float_products_active,
    geglu,
    gelu_rows,
    layer_norm_rows,
    matmul,
    rms_norm_rows,
    rope_into_cache,
    swiglu,
)
from .kernels.pages import populate, small_page_zeros
from .weights import Weights

if TYPE_CHECKING:
    from .tokenizer import StreamDetokenizer, Tokenizer


RESERVE_STEP = 256  # positions of the KV cache faulted in at a time (KVCache.reserve)


class ContextFullError(EngineError):
    """More tokens than the session's context holds."""


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    # x (t, d) -> (t, d)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    return xc * (1.0 / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)) * w + b


def gelu(x: np.ndarray) -> np.ndarray:
    # The tanh approximation, as ggml uses.
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608) * (x + np.float32(0.044715) * x * x * x)))


def rope_tables(
    cfg: ModelConfig, n_pos: int, freq_factors: np.ndarray | None, local: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position's rotation angles: each (n_pos, rope_dim/2) float32, for the global
    layers or (local) the sliding-window ones, which may have their own base and scale."""
    half = cfg.rope_dim // 2
    base, scale = (cfg.rope_base_local, cfg.rope_scale_local) if local else (cfg.rope_base, cfg.rope_scale)
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    angles = np.outer(np.arange(n_pos, dtype=np.float64) * scale, inv_freq)  # (n_pos, half)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def soft_cap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap · tanh(x / cap), in float32: the final logits' soft-cap."""
    return (np.float32(cap) * np.tanh(x / np.float32(cap))).astype(np.float32)


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
    k and v to float16 anyway, so the cache is exact at half the memory of float32. A sliding-window layer
    keeps only a ring of `cfg.cache_rows` positions (position p in row p % rows); `k[i]`, `v[i]` are layer
    first + i's (n_kv, rows, hd) either way."""

    def __init__(self, cfg: ModelConfig, n_ctx: int, offload: Offload | None = None):
        first = offload.n_layers if offload is not None else 0
        rows = [cfg.cache_rows(li, n_ctx) for li in range(first, cfg.n_layer)]
        if all(r == n_ctx for r in rows):  # no ring: one array, (layer - first, kv head, position, hd)
            shape = (len(rows), cfg.n_kv_head, n_ctx, cfg.head_dim)
            self.k, self.v = small_page_zeros(shape, np.float16), small_page_zeros(shape, np.float16)
        else:  # per layer (kv head, row, hd), the rings shorter
            self.k = [small_page_zeros((cfg.n_kv_head, r, cfg.head_dim), np.float16) for r in rows]
            self.v = [small_page_zeros((cfg.n_kv_head, r, cfg.head_dim), np.float16) for r in rows]
        self.device = offload.new_cache(n_ctx) if offload is not None else None
        self.n_ctx = n_ctx
        # Positions a ring keeps (None: no ring, every position stays), and how far back a query looks.
        self.ring_rows = min((cfg.cache_rows(li, n_ctx) for li in range(cfg.n_layer) if cfg.local[li]), default=None)
        if self.ring_rows is not None and self.ring_rows >= n_ctx:
            self.ring_rows = None
        self.window = cfg.sliding_window
        self.low = 0  # the oldest position every ring still holds (Session.truncate's check)
        self.resident = 0  # positions below this have their pages in memory (`reserve`)

    def reserve(self, end: int) -> None:
        """Fault in the pages of every position below `end` (rounded up to RESERVE_STEP) before a pass writes
        them. Faulted one by one inside the pass's parallel loops, where both threads take page faults at
        once, they cost SmolLM2's first 256-token prompt 10-11 ms of rope_into_cache's 12-13 (1.9 ms on
        pages already in; Zen 5 VM); one madvise per head and layer from this thread costs a fraction."""
        if end <= self.resident:
            return
        new = min(self.n_ctx, -(-end // RESERVE_STEP) * RESERVE_STEP)
        for layer in (*self.k, *self.v):  # (n_kv, rows, hd); a ring's row p % rows: all its rows at most
            lo, hi = min(self.resident, layer.shape[1]), min(new, layer.shape[1])
            for head in layer:
                if hi > lo and not populate(head[lo:hi]):
                    self.resident = self.n_ctx  # not supported here: leave the pages to fault in
                    return
        self.resident = new

    @property
    def nbytes(self) -> int:
        """Bytes of the CPU part."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


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
        *,
        warnings: list[str] | None = None,
        offload: Offload | None = None,
        device: str = "cpu",
        requantized: str = "",
    ):
        self.file = file
        self.cfg = cfg
        self.weights = weights
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.threads = threads
        self.warnings: list[str] = warnings if warnings is not None else []
        """Notes for the user from loading (clamped context, tokenizer, device fallback); appended to later."""
        self.load_s = 0.0  # what load_model took, compiling included: set by it once the kernels have run
        self.offload = offload  # the first layers on a device (--device cuda / --gpu-layers), or None
        self.device = device  # where the layers run, for display ("cpu", or the device and its share of layers)
        self.requantized = requantized  # what the weights were re-encoded to (a draft model's), for display
        n_pos = max(n_ctx, 1)
        rope_dim = cfg.rope_dim if cfg.spec.positions == "rope" else 0  # learned positions: nothing rotates
        if rope_dim:
            self._cos, self._sin = rope_tables(cfg, n_pos, weights.rope_freqs)
        else:
            self._cos = self._sin = np.zeros((n_pos, 0), dtype=np.float32)
        self._rope = [(self._cos, self._sin)] * cfg.n_layer  # per layer: its (cos, sin), each (n_pos, rope_dim/2)
        if rope_dim and any(cfg.local):
            local = rope_tables(cfg, n_pos, weights.rope_freqs, local=True)
            self._rope = [local if is_local else (self._cos, self._sin) for is_local in cfg.local]
        self._rope_shape = (cfg.n_head, cfg.n_kv_head, cfg.head_dim, rope_dim, cfg.spec.rope_neox)
        self.fused_decode = True  # single tokens take the one-call path (kernels.decode); False: the reference
        # With deterministic, every prompt row is computed as decoding its token alone computes it, bit for bit
        # (`forward`'s rowwise): logits then do not depend on how a prompt was split into passes or on what the
        # cache held before. Off by default: one-token attention rows cost Qwen2.5-Coder-1.5B's prefill far more
        # than 5 % past a few hundred positions (benchmarks/results/deterministic-prefill-intel-xeon.md).
        self.deterministic = False
        self._decode_layers: list[DecodeLayer | None] | None | bool = False  # False: not built yet (see _fast_layers)
        # The kernels use every core; two threads entering at once would oversubscribe them (and Numba's
        # workqueue layer aborts on it). One forward pass at a time, whoever calls.
        self._lock = threading.Lock()
        self._scratch = Scratch()  # a prompt pass's temporaries, reused by the next (under the lock)

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

    def stream_detokenizer(self) -> StreamDetokenizer:
        return self.tokenizer.stream_detokenizer()

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

    def forward(
        self, ids: np.ndarray, cache: KVCache, start: int, last_only: bool, rowwise: bool = False
    ) -> np.ndarray:
        """Run ids at positions start.. through the model, writing their K/V into cache.

        Returns logits (1, n_vocab) for the last token when last_only, else (t, n_vocab). With rowwise, every
        row's logits are those of decoding its token alone, bit for bit, at any length (draft checks; passes
        of up to kernels.SHORT_PASS tokens are so anyway).
        """
        with self._lock:
            logits = self._forward(ids, cache, start, last_only, rowwise or self.deterministic)
            if cache.ring_rows is not None:  # positions before this are overwritten in the rings
                cache.low = max(cache.low, start + len(ids) - cache.ring_rows)
            return logits

    def _forward(self, ids: np.ndarray, cache: KVCache, start: int, last_only: bool, rowwise: bool) -> np.ndarray:
        cfg, w = self.cfg, self.weights
        t = len(ids)
        x = embedding_rows(w.token_embd, ids, w.token_rows)  # (t, d)
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)
        if w.position_embd is not None:
            x += w.position_embd[start : start + t]
        first = 0
        if self.offload is not None:
            x = self.offload.forward_layers(x, cache.device, start)
            first = self.offload.n_layers
        cache.reserve(start + t)
        fast = self._fast_layers() if t == 1 else None
        for li in range(first, cfg.n_layer):
            kc, vc = cache.k[li - first], cache.v[li - first]  # (n_kv, rows, hd): this layer's cache
            cos, sin = self._rope[li]
            if fast is not None:  # one token: the whole layer in one compiled call, same arithmetic as _layer
                fast[li](x[0], start, kc, vc, cos[start], sin[start])
            else:
                self._layer(li, x, kc, vc, start, rowwise)
        if last_only:
            x = x[-1:]
        if self.offload is not None and self.offload.runs_output:
            return self.offload.output(x)
        x = self._norm(x, w.output_norm, w.output_norm_b, rowwise=rowwise)
        logits = matmul(w.output, x, rowwise=rowwise)  # (t, n_vocab)
        return soft_cap(logits, cfg.final_softcap) if cfg.final_softcap else logits

    def _layer(self, li: int, x: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int, rowwise: bool) -> None:
        """x (t, d) at positions start.., in place, through layer li; its keys and values go into kc, vc."""
        cfg, lw, work = self.cfg, self.weights.layers[li], self._scratch
        t, hd, eps = x.shape[0], cfg.head_dim, cfg.norm_eps

        def product(name: str, m: WeightMatrix, h: np.ndarray, again: bool = False) -> np.ndarray:
            """(t, m.rows) in `name`; again: h is the last product's input, unchanged."""
            return matmul(m, h, out=work.take(name, (t, m.rows)), scratch=work, same_input=again, rowwise=rowwise)

        h = self._norm(x, lw.attn_norm, lw.attn_norm_b, out=work.take("norm", x.shape), rowwise=rowwise)
        biases = lw.bqkv or (None, None, None)
        q, k, v = (
            self._bias(product(n, m, h, again=n != "q"), b) for n, m, b in zip("qkv", lw.wqkv, biases, strict=True)
        )
        if lw.q_norm is not None:  # per head, before RoPE, in place
            rms_norm_rows(q.reshape(-1, hd), lw.q_norm, eps, out=q.reshape(-1, hd))  # (t·n_head, hd)
            rms_norm_rows(k.reshape(-1, hd), lw.k_norm, eps, out=k.reshape(-1, hd))  # (t·n_kv, hd)
        # Keys, values and queries carry half precision into attention, as llama.cpp's F16 KV cache does:
        # matching its rounding keeps near-tie tokens the same as llama.cpp picks them.
        cos, sin = self._rope[li]
        rope_into_cache(q, k, v, kc, vc, start, cos[start : start + t], sin[start : start + t], self._rope_shape)
        window, scale, cap = cfg.window(li), cfg.attn_scale, cfg.attn_softcap
        a = work.take("attention", (t, cfg.n_head * hd))  # (t, n_head·hd)
        a = causal_attention(
            q.reshape(t, cfg.n_head, hd), kc, vc, start, scale, window, cap, out=a, rowwise=rowwise, scratch=work
        )
        o = self._bias(product("o", lw.wo, a), lw.bo)  # (t, d)
        if lw.post_attn_norm is not None:
            rms_norm_rows(o, lw.post_attn_norm, eps, out=o)
        x += o
        h = self._norm(x, lw.ffn_norm, lw.ffn_norm_b, out=work.take("norm", x.shape), rowwise=rowwise)
        if cfg.spec.ffn in ("swiglu", "geglu"):  # (t, d_ff): act(gate) * up, into gate's buffer
            gate, up = product("gate", lw.w_gate, h), product("up", lw.w_up, h, again=True)
            h = (swiglu if cfg.spec.ffn == "swiglu" else geglu)(gate, up, out=gate)
        else:
            h = (gelu_rows if rowwise else gelu)(self._bias(product("up", lw.w_up, h), lw.b_up))
        f = self._bias(product("down", lw.w_down, h), lw.b_down)  # (t, d)
        if lw.post_ffn_norm is not None:
            rms_norm_rows(f, lw.post_ffn_norm, eps, out=f)
        x += f

    def _fast_layers(self) -> list[DecodeLayer | None] | None:
        """Every layer's one-call decode arguments, when the weight types allow it."""
        if not self.fused_decode or float_products_active():
            return None
        if self._decode_layers is False:
            self._decode_layers = self._build_decode_layers()
        return self._decode_layers

    def _build_decode_layers(self) -> list[DecodeLayer | None] | None:
        cfg, spec = self.cfg, self.cfg.spec
        first = self.offload.n_layers if self.offload is not None else 0
        layers: list[DecodeLayer | None] = [None] * first  # offloaded layers: never run here, never packed
        for li in range(first, cfg.n_layer):
            lw = self.weights.layers[li]
            if not DecodeLayer.fits((*lw.wqkv, lw.wo, lw.w_gate, lw.w_up, lw.w_down)):
                return None
            norms = (lw.attn_norm, lw.attn_norm_b, lw.ffn_norm, lw.ffn_norm_b, lw.q_norm, lw.k_norm,
                     lw.post_attn_norm, lw.post_ffn_norm)  # fmt: skip
            biases = (*(lw.bqkv or (None, None, None)), lw.bo, lw.b_up, lw.b_down)
            flags = (decode.FFN_KINDS[spec.ffn], spec.norm == "layer", cfg.window(li))
            consts = (cfg.norm_eps, cfg.attn_scale, cfg.attn_softcap)
            layers.append(
                DecodeLayer(
                    norms, lw.wqkv, lw.wo, (lw.w_gate, lw.w_up, lw.w_down), biases, (*self._rope_shape, *flags), consts
                )  # fmt: skip
            )
        return layers

    def _norm(
        self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None = None,
        rowwise: bool = False,
    ) -> np.ndarray:  # fmt: skip
        if self.cfg.spec.norm == "rms":
            return rms_norm_rows(x, weight, self.cfg.norm_eps, out=out)
        if rowwise:  # each row as the one-token layer normalizes it
            return layer_norm_rows(x, weight, bias, self.cfg.norm_eps, out=out)
        return layer_norm(x, weight, bias, self.cfg.norm_eps)

    @staticmethod
    def _bias(y: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        if b is not None:
            y += b
        return y


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
        """Append ids to the cache; return float32 (len(ids), n_vocab) logits, one row per id, each bit for bit
        what decoding that id alone would give (draft checks)."""
        arr = self.model._check_ids(ids)
        if self.n_past + len(arr) > self.n_ctx:
            raise ContextFullError(f"{self.n_past} cached + {len(arr)} new tokens exceed the context of {self.n_ctx}")
        parts = []
        for i in range(0, len(arr), PREFILL_CHUNK):
            chunk = arr[i : i + PREFILL_CHUNK]
            parts.append(self.model.forward(chunk, self.cache, self.n_past, last_only=False, rowwise=True))
            self.tokens.extend(int(t) for t in chunk)
        return np.concatenate(parts, axis=0)

    def truncate(self, n: int) -> None:
        """Forget every position from n on (their cache slots are overwritten by later evals).

        Where sliding-window rings have lost keys that position n would read (the forgotten tokens overwrote
        them), the n kept tokens are evaluated again, as llama.cpp re-processes a prompt its SWA cache lacks.
        """
        if not 0 <= n <= self.n_past:
            raise SettingsError(f"cannot truncate a session of {self.n_past} tokens to {n}")
        del self.tokens[n:]
        cache = self.cache
        if cache.ring_rows is not None and n > 0 and max(0, n - cache.window + 1) < cache.low:
            kept, self.tokens = self.tokens, []
            cache.low = 0
            self.eval(kept)
