"""Where a decoded token's time goes: the one-token pass of every layer (decode.layer) timed whole, and its
products and its attention timed alone on the same arguments; the rest of the layer is the difference.

`split_token` times the real one-token pass of a session, then the parts on that same state (same weights,
same position, same cache), so every figure is a measured time per token, not a model of one:
- layers: decode.layer itself over every layer (its cache row at the next position is scratch until the next
  real step writes it);
- products: the layer's matrix-vector products, launched as decode.layer launches them (products3, product,
  gated_ffn), on the activations' shapes; a gated FFN's activation and the quantization of its result run
  inside its first launch, on every thread, and count here;
- attention: attend_one over the cached positions (parallel at depth, as decode.layer runs it);
- the rest of the layers (norms, q/k norms, RoPE, the cache write, biases, residuals, and the activation of an
  FFN that runs it apart: ungated, or not packed): layers less products and attention, so the layer's code
  exists once, in decode.py.
Outside the layers: the embedding row and the final norm, the output head, and the sampler's argmax. Thread
wake-ups are measured as the cost of an empty parallel launch times the launches the products make; they are
a part of the products' time, shown beside it, not added again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import get_num_threads, njit, prange

from .attention import attend_one
from .decode import gated_ffn, product, products3

if TYPE_CHECKING:
    from ..model import Session

REST = "rest of the layers"  # by difference: the layers' whole pass less their products and attention


@njit(cache=True, nogil=True)
def layer_products(x, wq, wk, wv, wo, w_gate, w_up, b_up, w_down, n_head, n_kv, head_dim, d_ff, ffn_kind, gelu,
                   parallel_min_bytes):  # fmt: skip
    """decode.layer's products alone, launched as it launches them; x (d,) is read, not changed."""
    d = x.shape[0]
    h = x.copy()
    q = np.empty(n_head * head_dim, dtype=np.float32)  # (n_head·hd,)
    k = np.empty(n_kv * head_dim, dtype=np.float32)  # (n_kv·hd,)
    v = np.empty(n_kv * head_dim, dtype=np.float32)
    products3(wq, wk, wv, h, q, k, v, parallel_min_bytes)
    o = np.empty(d, dtype=np.float32)
    product(wo, q, o, parallel_min_bytes)
    if ffn_kind == 2:
        up = np.empty(d_ff, dtype=np.float32)
        product(w_up, h, up, parallel_min_bytes)
        product(w_down, up, o, parallel_min_bytes)
    else:
        gated_ffn(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, o, parallel_min_bytes)


def layer_attention(kc, vc, pos, threads, n_head, head_dim, attn_scale, window, softcap):
    """decode.layer's attend_one alone, a query of ones over the cache as it stands (position pos written)."""
    q = np.ones(n_head * head_dim, dtype=np.float32)  # (n_head·hd,)
    a = np.empty(n_head * head_dim, dtype=np.float32)
    attend_one(q, kc, vc, pos, n_head, attn_scale, window, softcap, threads, a)


@njit(parallel=True, cache=True, nogil=True)
def _empty_launch(out):
    """A parallel region with one trivial item per thread: the cost of waking the threads and joining them."""
    for i in prange(out.shape[0]):
        out[i] += 1.0


@njit(cache=True, nogil=True)
def _launches(out, n):
    for _ in range(n):
        _empty_launch(out)


@dataclass
class TokenSplit:
    """Seconds per decoded token (medians over the tokens measured) of the whole step and of each part."""

    total_s: float  # session.eval of one token plus the argmax: what a decoded token costs
    parts_s: dict[str, float]  # products, attention, the layers' rest, output head, embed + final norm, sampling
    launches: int  # parallel launches the products make per token
    launch_s: float  # of which thread wake-ups: launches × one empty launch's cost (inside products_s)
    product_bytes: int  # weight bytes the layers' products and the head read per token
    depth: int  # cached positions when the first measured token was decoded
    runs: dict[str, list[float]] = field(default_factory=dict)  # every measurement, per part

    @property
    def parts_sum_s(self) -> float:
        return sum(self.parts_s.values())

    @property
    def unaccounted_s(self) -> float:
        """The step less its parts, round by round (each round's parts ran on the state its step left, under
        the same load), the median of those: the medians of the whole and of each part apart would set one
        round's step against another's parts."""
        parts = [name for name in self.runs if name != "total"]
        rounds = zip(self.runs["total"], *(self.runs[name] for name in parts), strict=True)
        return statistics.median([total - sum(rest) for total, *rest in rounds])


def _parallel_launches(args: Any, parallel_min_bytes: int) -> int:
    """The parallel launches decode.layer's products make: a group launches once when its packed bytes reach
    the threshold (products3 / gated_ffn / product, decode.py)."""

    def size(w: tuple) -> int:
        return sum(a.nbytes for a in w[:2]) if len(w) == 3 else w[0].nbytes

    w = {n: getattr(args, n) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    groups = [("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up") if args.ffn_kind != 2 else ("w_up",), ("w_down",)]
    count = 0
    for g in groups:
        packed = all(len(w[n]) == 3 for n in g)
        if len(g) > 1 and packed and sum(w[n][0].nbytes for n in g) >= parallel_min_bytes:
            count += 1
        else:
            count += sum(size(w[n]) >= parallel_min_bytes for n in g)
    return count


def split_token(session: Session, n_tokens: int = 16) -> TokenSplit:
    """Decode n_tokens greedy tokens in `session` (which must hold at least one token), timing each step, and
    time every part of that step on the same state n_tokens times. Fused one-token models only."""
    from ..kernels import matmul
    from ..kernels.prompt_ops import norm_rows
    from ..kernels.rows import embedding_rows
    from ..layer import output_norm

    model = session.model
    layers = model._fast_layers()
    if layers is None or model.offload is not None:
        raise ValueError(f"{model.name}: its layers do not all run the one-token kernel, so there is no split")
    if session.n_past == 0 or session.n_past + n_tokens + 3 > session.n_ctx:
        raise ValueError("the split needs a session with tokens in it and room for n_tokens + 3 more")
    cfg, w, cache = model.cfg, model.weights, session.cache
    norm = output_norm(cfg, w)
    threads = get_num_threads()
    logits = session.eval([session.tokens[-1]])
    start = session.n_past
    names = ("products", "attention", REST, "output head", "embed + final norm", "sampling (argmax)")
    runs: dict[str, list[float]] = {"total": [], **{name: [] for name in names}}
    # Each round: one real step, then every part on the state it left, so that a shared machine's load
    # falls on the whole and its parts alike.
    for _ in range(n_tokens + 1):  # the first round compiles the parts: not counted
        t = time.perf_counter()
        logits = session.eval([int(np.argmax(logits))])
        np.argmax(logits)
        total = time.perf_counter() - t
        pos = session.n_past  # the next position: its cache row is scratch until the next real step writes it
        ids = np.array([session.tokens[-1]])
        x = np.asarray(embedding_rows(w.token_embd, ids, w.token_rows), np.float32)[0]  # (d,)
        times = {"total": total}
        caches = cache.kernel_views
        xs = x.copy()
        t = time.perf_counter()
        for layer, (kc, vc) in zip(layers, caches, strict=True):
            layer(xs, pos, kc, vc)  # the one-token pass itself (DecodeLayer)
        whole = time.perf_counter() - t
        t = time.perf_counter()
        for layer in layers:
            a = layer.args
            layer_products(x, a.wq, a.wk, a.wv, a.wo, a.w_gate, a.w_up, a.b_up, a.w_down, a.n_head, a.n_kv,
                           a.head_dim, a.d_ff, a.ffn_kind, a.gelu, a.parallel_min_bytes)  # fmt: skip
        times["products"] = time.perf_counter() - t
        t = time.perf_counter()
        for layer, (kc, vc) in zip(layers, caches, strict=True):
            a = layer.args
            layer_attention(kc, vc, pos, threads, a.n_head, a.head_dim, a.attn_scale, a.window, a.softcap)
        times["attention"] = time.perf_counter() - t
        times[REST] = whole - times["products"] - times["attention"]
        t = time.perf_counter()
        matmul(w.output, x[None])  # (1, n_vocab)
        times["output head"] = time.perf_counter() - t
        t = time.perf_counter()
        norm_rows(embedding_rows(w.token_embd, ids, w.token_rows), norm, False)  # (1, d)
        times["embed + final norm"] = time.perf_counter() - t
        t = time.perf_counter()
        np.argmax(logits)
        times["sampling (argmax)"] = time.perf_counter() - t
        for name, v in times.items():
            runs[name].append(v)
    runs = {name: r[1:] for name, r in runs.items()}
    pmb = layers[0].args.parallel_min_bytes
    launches = sum(_parallel_launches(layer.args, pmb) for layer in layers) + 1  # + the head's
    scratch = np.zeros(threads, np.float32)
    _launches(scratch, 1)
    launch_runs = []
    for _ in range(5):
        t = time.perf_counter()
        _launches(scratch, 1000)
        launch_runs.append((time.perf_counter() - t) / 1000)
    parts = {name: statistics.median(r) for name, r in runs.items() if name != "total"}
    product_bytes = sum(m.nbytes for m in w.products())
    return TokenSplit(
        total_s=statistics.median(runs["total"]), parts_s=parts, launches=launches,
        launch_s=launches * min(launch_runs), product_bytes=product_bytes, depth=start, runs=runs,
    )  # fmt: skip
