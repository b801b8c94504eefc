"""The forward pass on the CPU: one function for every family.

embed -> per layer (engine/layer.py: norm -> q, k, v [-> q/k norm] -> RoPE -> attention over the KV cache
[-> post-norm] -> residual -> norm -> FFN [-> post-norm] -> residual) -> norm -> logits [-> soft-cap].
Each layer is read from its LayerSpec (engine.layer.layer_specs: the model's config and the layer's weights).
A prompt runs `run_layer` with each op a compiled kernel over all its rows (kernels/prompt_ops.py); one token
runs each layer in one compiled call (kernels/one_token.py DecodeLayer) with the same arithmetic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from .cache_types import cache_bits, row_layout
from .config import PREFILL_CHUNK, ModelConfig
from .errors import EngineError, SettingsError
from .gguf_file import GGUFFile
from .kernels import Scratch, embedding_rows, float_products_active, matmul
from .kernels.one_token import DecodeLayer
from .kernels.pages import populate, small_page_zeros
from .kernels.prompt_ops import PromptOps, norm_rows
from .kernels.prompt_ops import gelu as gelu  # the NumPy statements of the prompt path, named here as before
from .kernels.prompt_ops import layer_norm as layer_norm
from .layer import LayerSpec, layer_specs, output_norm, rope_per_layer, run_layer
from .layer import rope_tables as rope_tables
from .weights import Weights

if TYPE_CHECKING:
    from .tokenizer import StreamDetokenizer, Tokenizer


RESERVE_STEP = 256  # positions of the KV cache faulted in at a time (KVCache.reserve)


class ContextFullError(EngineError):
    """More tokens than the session's context holds."""


def soft_cap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap · tanh(x / cap), in float32: the final logits' soft-cap."""
    return (np.float32(cap) * np.tanh(x / np.float32(cap))).astype(np.float32)


class Offload(Protocol):
    """Layers [0, n_layers) -- and the output head when `runs_output` -- run on another device (engine.gpu).

    Their KV cache lives on that device, in the object `new_cache` returns; activations cross as NumPy arrays.
    """

    n_layers: int
    runs_output: bool

    def new_cache(self, n_ctx: int, type_k: str, type_v: str) -> object:
        """The offloaded layers' cache for n_ctx positions, keys and values stored as those cache types."""
        ...

    # The cache is the device's own object (`new_cache`'s); each offload takes its own type, hence Any.
    def forward_layers(self, x: np.ndarray, cache: Any, start: int) -> np.ndarray:
        """x (t, d) float32 at positions start.. through the offloaded layers -> (t, d) float32."""
        ...

    def output(self, x: np.ndarray) -> np.ndarray:
        """Final norm and output head: x (t, d) -> logits (t, n_vocab) float32."""
        ...


class KVCache:
    """Keys and values for n_ctx positions, allocated once: the CPU layers' here, the offloaded layers' in
    `device` (None without offload). Stored as `type_k` and `type_v` (engine/cache_types.py): f16 by default,
    as llama.cpp's default cache (the forward pass rounds k and v to float16 anyway, so that cache is exact at
    half the memory of float32), or q8_0 blocks at 53 % of that. A sliding-window layer keeps only a ring of
    `cfg.cache_rows` positions (position p in row p % rows); `k[i]`, `v[i]` are layer first + i's
    (n_kv, rows, width) either way: width hd float16, or hd/32·34 bytes."""

    def __init__(
        self, cfg: ModelConfig, n_ctx: int, offload: Offload | None = None, type_k: str = "f16", type_v: str = "f16"
    ):
        first = offload.n_layers if offload is not None else 0
        rows = [cfg.cache_rows(li, n_ctx) for li in range(first, cfg.n_layer)]
        self.k: np.ndarray | list[np.ndarray]
        self.v: np.ndarray | list[np.ndarray]
        (dtype_k, width_k), (dtype_v, width_v) = row_layout(type_k, cfg.head_dim), row_layout(type_v, cfg.head_dim)
        if all(r == n_ctx for r in rows):  # no ring: one array, (layer - first, kv head, position, width)
            self.k = small_page_zeros((len(rows), cfg.n_kv_head, n_ctx, width_k), dtype_k)
            self.v = small_page_zeros((len(rows), cfg.n_kv_head, n_ctx, width_v), dtype_v)
        else:  # per layer (kv head, row, width), the rings shorter
            self.k = [small_page_zeros((cfg.n_kv_head, r, width_k), dtype_k) for r in rows]
            self.v = [small_page_zeros((cfg.n_kv_head, r, width_v), dtype_v) for r in rows]
        self.type_k, self.type_v = type_k, type_v
        # each CPU layer's (k, v) as the kernels take them (cache_types.cache_bits), made once: views of the above
        self.kernel_views = [(cache_bits(k), cache_bits(v)) for k, v in zip(self.k, self.v, strict=True)]
        self.device = offload.new_cache(n_ctx, type_k, type_v) if offload is not None else None
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
        deterministic: bool = False,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        prepare: Callable[[Model], None] | None = None,
        started: float | None = None,
    ):
        """`prepare` runs once the model is whole (load_model's kernel warm-up); `load_s` then counts from
        `started` (a time.perf_counter() reading, default now) to its end."""
        started = time.perf_counter() if started is None else started
        self.file = file
        self.cfg = cfg
        self.weights = weights
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.threads = threads
        self.warnings: list[str] = warnings if warnings is not None else []
        """Notes for the user from loading (clamped context, tokenizer, device fallback); appended to later."""
        self.offload = offload  # the first layers on a device (--device cuda / --gpu-layers), or None
        self.device = device  # where the layers run, for display ("cpu", or the device and its share of layers)
        self.requantized = requantized  # what the weights were re-encoded to (a draft model's), for display
        self._rope = rope_per_layer(cfg, max(n_ctx, 1), weights.rope_freqs)  # per layer (cos, sin) (n_pos, rope_dim/2)
        # Every layer's LayerSpec, built on first use from the config and the tables (again if either is replaced).
        self._specs: tuple[ModelConfig, list, list[LayerSpec]] | None = None
        self.fused_decode = True  # single tokens take the one-call path (kernels.decode); False: the reference
        # With deterministic, every prompt row is computed as decoding its token alone computes it, bit for bit
        # (`forward`'s rowwise): logits then do not depend on how a prompt was split into passes or on what the
        # cache held before. Off by default: one-token attention rows cost Qwen2.5-Coder-1.5B's prefill far more
        # than 5 % past a few hundred positions (benchmarks/results/deterministic-prefill-intel-xeon.md).
        self.deterministic = deterministic
        # The KV cache's types (engine/cache_types.py, llama.cpp's -ctk/-ctv): of every cache this model makes.
        self.cache_type_k = cache_type_k
        self.cache_type_v = cache_type_v
        self._decode_layers: list[DecodeLayer] | Literal[False] | None = False  # False: not built yet (_fast_layers)
        # The kernels use every core; two threads entering at once would oversubscribe them (and Numba's
        # workqueue layer aborts on it). One forward pass at a time, whoever calls.
        self._lock = threading.Lock()
        self._scratch = Scratch()  # a prompt pass's temporaries, reused by the next (under the lock)
        if prepare is not None:
            prepare(self)
        self.load_s = time.perf_counter() - started  # what building took: load_model's, compiling included

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

    def new_cache(self, n_ctx: int) -> KVCache:
        """An empty KV cache of n_ctx positions, of the model's cache types."""
        return KVCache(self.cfg, n_ctx, self.offload, self.cache_type_k, self.cache_type_v)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of `ids` in a fresh context: float32 (len(ids), n_vocab)."""
        arr = self._check_ids(ids)
        if len(arr) > self.n_ctx:
            raise ContextFullError(f"{len(arr)} tokens do not fit the context of {self.n_ctx}")
        cache = self.new_cache(len(arr))
        parts = [
            self.forward(arr[i : i + PREFILL_CHUNK], cache, i, last_only=False)
            for i in range(0, len(arr), PREFILL_CHUNK)
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

    def layer_specs(self) -> list[LayerSpec]:
        """Every layer's LayerSpec, with RoPE tables for n_ctx positions: built on first use, and again when the
        config or the tables are replaced."""
        if self._specs is None or self._specs[0] is not self.cfg or self._specs[1] is not self._rope:
            self._specs = (self.cfg, self._rope, layer_specs(self.cfg, self.weights, self._rope))
            self._decode_layers = False
        return self._specs[2]

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
        specs = self.layer_specs()
        fast = self._fast_layers() if t == 1 else None
        ops = PromptOps(cache.k, cache.v, first, start, t, rowwise, self._scratch)
        for li in range(first, cfg.n_layer):
            if fast is not None:  # one token: the whole layer in one compiled call, the same arithmetic
                fast[li - first](x[0], start, *cache.kernel_views[li - first])
            else:
                x = run_layer(ops, specs[li], x)
        if last_only:
            x = x[-1:]
        if self.offload is not None and self.offload.runs_output:
            return self.offload.output(x)
        x = norm_rows(x, output_norm(cfg, w), rowwise)
        logits = matmul(w.output, x, rowwise=rowwise)  # (t, n_vocab)
        if cfg.logit_scale != 1.0:
            logits /= np.float32(cfg.logit_scale)
        return soft_cap(logits, cfg.final_softcap) if cfg.final_softcap else logits

    def _fast_layers(self) -> list[DecodeLayer] | None:
        """The one-call decode step of every layer that runs here (not offloaded), when the kernel runs them all."""
        if not self.fused_decode or float_products_active():
            return None
        specs = self.layer_specs()
        if self._decode_layers is False:
            first = self.offload.n_layers if self.offload is not None else 0
            mine = specs[first:]  # offloaded layers: never run here, never packed
            fits = all(DecodeLayer.fits(spec) for spec in mine)
            self._decode_layers = [DecodeLayer(spec) for spec in mine] if fits else None
        return self._decode_layers


class Session:
    """A conversation's state on one model: a KV cache of n_ctx positions and the token ids it holds."""

    def __init__(self, model: Model, n_ctx: int):
        self.model = model
        self.cache = model.new_cache(n_ctx)
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
        assert logits is not None  # _check_ids refuses an empty list: the loop ran
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
