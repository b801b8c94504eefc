"""The mixture-of-experts FFN on the CPU: a router picks, for each token, a few experts out of many, and the
token's FFN output is their weighted sum (llama.cpp's `build_moe_ffn` with softmax gating, as qwen3moe uses it).

    logits = router @ h                 (t, n_expert)
    p      = softmax(logits)            per token
    ids    = top-k of p                 (t, k), k = expert_used_count
    w      = p[ids] / sum(p[ids])       (t, k), renormalised where the family says so (qwen3moe: norm_w)
    out[i] = sum_j w[i, j] · down_e(silu(gate_e(h[i])) · up_e(h[i])),  e = ids[i, j]
           + sigmoid(g_s · h[i]) · down_s(silu(gate_s(h[i])) · up_s(h[i]))   with a shared expert (qwen2moe;
                                                                               Granite's: no sigmoid factor)

The experts live in three 3-D tensors of the file (n_expert stacked matrices each), left mapped. An expert is a
`WeightMatrix` view of its rows, made the first time a token chooses it; only then is it repacked (and its
file pages released), so memory holds the experts the text used, not all of them. The packed experts of a
tensor lie in one array (its arena, in small pages that the kernel hands out as they are first written), so
that one compiled launch reaches every chosen expert (kernels/experts.py).

A pass of several tokens groups them by expert: each chosen expert's weights are read once per pass, for all the
tokens that chose it. Where the experts are of packed types, the pass's tokens are sorted by expert once and
the gate, up and down products of all the chosen experts run as three launches (Qwen3-30B-A3B's shape, 256
tokens: 49 experts a layer chosen, each once per pass; three products a chosen expert, one by one, left a
third of the prompt's time to Python and to launches); otherwise (float experts, float products) one expert
at a time.

`RouterFfn` is a variant of a layer's FFN (engine/layer.py): its `apply` names the backend's op, `router_ffn`
here for the CPU's prompt pass (PromptOps), which single tokens take too (the fused one-token kernel declines
such layers), and engine/gpu/offload.py's DeviceOps.router_ffn on a device; both route with `route` and group
with `by_expert`.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from .config import ModelConfig
from .formats.dispatch import tag
from .gguf_file import GGUFFile, TensorEntry
from .kernels import (
    BLOCK_CODES,
    PACKED_TYPES,
    PackedWeight,
    WeightMatrix,
    experts,
    float_products_active,
    matmul,
    matvec_many,
    packed,
    pages,
    prepare_stacked,
    swiglu,
)

_view_lock = threading.Lock()


@dataclass(frozen=True, eq=False)
class ExpertTensor:
    """n_expert matrices (rows, cols) stacked in one tensor, in the file's encoding: `data` is the whole tensor
    as WeightMatrix keeps one matrix (rows of n_expert·rows), expert e its rows [e·rows, (e+1)·rows)."""

    name: str
    ggml_type: T
    n_expert: int
    rows: int  # output features of one expert
    cols: int  # input features
    data: np.ndarray  # (n_expert·rows, row_bytes) uint8, or (n_expert·rows, cols) for float types; a file view
    _views: dict[int, WeightMatrix] = field(default_factory=dict, init=False, repr=False)
    _arena: list[np.ndarray] = field(default_factory=list, init=False, repr=False)  # [q_all, s_all] once packing

    @classmethod
    def of(cls, t: TensorEntry) -> ExpertTensor:
        """A 3-D tensor entry, ggml shape (cols, rows, n_expert)."""
        cols, rows, n_expert = t.shape
        whole = WeightMatrix.from_raw(t.name, t.ggml_type, n_expert * rows, cols, t.data)
        return cls(t.name, t.ggml_type, n_expert, rows, cols, whole.data)

    def expert(self, e: int) -> WeightMatrix:
        """Expert e as a matrix (rows, cols): a view of its rows, no copy; the same object on every call, so that
        its packed copy is built once."""
        w = self._views.get(e)
        if w is None:
            if not 0 <= e < self.n_expert:
                raise IndexError(f"{self.name}: expert {e} of {self.n_expert}")
            with _view_lock:
                w = self._views.get(e)
                if w is None:
                    rows = self.data[e * self.rows : (e + 1) * self.rows]
                    storage = functools.partial(self._storage, e)
                    w = WeightMatrix(f"{self.name}[{e}]", self.ggml_type, self.rows, self.cols, rows, storage)
                    self._views[e] = w
        return w

    def _storage(self, e: int, q_shape: tuple[int, ...], s_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Expert e's packed arrays: its place in the arena, made when the first expert is packed. Small pages:
        huge ones would make a chosen expert's neighbours resident too, and cost more to fault in here (Intel
        Xeon, KVM: 0.62-0.66 ms to pack an 885 KB Q4_K expert into 2 MB pages, 0.42-0.46 into 4 KB ones)."""
        with _view_lock:
            if not self._arena:
                self._arena.append(pages.small_page_zeros((self.n_expert, *q_shape), np.uint8))
                self._arena.append(pages.small_page_zeros((self.n_expert, *s_shape), np.uint16))
        q_all, s_all = self._arena
        return q_all[e], s_all[e]

    def packed_arena(self, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(q_all, s_all) with the experts `chosen` packed in it, those not yet packed in one launch; None where
        this tensor's type is not packed."""
        if self.ggml_type not in PACKED_TYPES:
            return None
        if not self._arena:
            self._storage(0, *PackedWeight.shapes(BLOCK_CODES[self.ggml_type], self.rows, self.cols))
        q_all, s_all = self._arena
        prepare_stacked([self.expert(e) for e in chosen.tolist()], self.data, q_all, s_all, chosen)
        return q_all, s_all

    def touched(self) -> list[int]:
        """The experts some product has read so far."""
        return sorted(self._views)


@dataclass(frozen=True, eq=False)
class RouterFfn:
    """A mixture-of-experts FFN layer: the router and the experts' SwiGLU matrices."""

    router: WeightMatrix  # (n_expert, d): ffn_gate_inp, F32 in llama.cpp's quantized files
    gate: ExpertTensor  # n_expert × (d_ff_exp, d)
    up: ExpertTensor  # n_expert × (d_ff_exp, d)
    down: ExpertTensor  # n_expert × (d, d_ff_exp)
    n_used: int  # experts per token (top-k)
    norm_weights: bool  # renormalise the chosen probabilities to sum to 1
    # The shared expert every token runs: its gate, up, down and its scalar gate ffn_gate_inp_shexp as a (1, d)
    # matrix (None where ungated, Granite's); None without one.
    shared: tuple[WeightMatrix, WeightMatrix, WeightMatrix, WeightMatrix | None] | None = None

    @classmethod
    def bind(cls, file: GGUFFile, cfg: ModelConfig, layer: int) -> RouterFfn:
        """Layer `layer`'s router FFN, as views of the mapped file (tensors checked by weights.check_tensors)."""
        ts, p = file.tensors, f"blk.{layer}."
        r = ts[p + "ffn_gate_inp.weight"]
        router = WeightMatrix.from_raw(r.name, r.ggml_type, r.shape[1], r.shape[0], r.data)
        gate, up, down = (ExpertTensor.of(ts[p + f"ffn_{n}_exps.weight"]) for n in ("gate", "up", "down"))
        shared = None
        if cfg.d_ff_shexp:
            mats: list[WeightMatrix | None] = [None] * 4
            for i, n in enumerate(("gate", "up", "down", "gate_inp")[: 4 if cfg.spec.shared_expert == "gated" else 3]):
                t = ts[p + f"ffn_{n}_shexp.weight"]
                cols, rows = t.shape if len(t.shape) == 2 else (t.shape[0], 1)
                mats[i] = WeightMatrix.from_raw(t.name, t.ggml_type, rows, cols, t.data)
            gate_s, up_s, down_s, gate_inp_s = mats
            assert gate_s is not None and up_s is not None and down_s is not None  # the three are always read
            shared = (gate_s, up_s, down_s, gate_inp_s)
        return cls(router, gate, up, down, cfg.n_expert_used, cfg.spec.moe_norm_weights, shared)

    def apply(self, ops: Any, h: np.ndarray) -> Any:
        """As a layer's FFN variant: the backend's router op (its CPU form is `router_ffn`)."""
        return ops.router_ffn(h, self)

    def matrices(self) -> list[WeightMatrix]:
        """The matrices every token reads: the router and the shared expert. Experts are prepared when first chosen
        (`ExpertTensor`)."""
        return [self.router, *(m for m in self.shared or () if m is not None)]

    def expert_bytes(self) -> int:
        """The bytes of experts one token reads: n_used experts' gate, up and down, as the file stores them."""
        return self.n_used * sum(t.data.nbytes // t.n_expert for t in (self.gate, self.up, self.down))

    def touched(self) -> list[int]:
        """Experts whose weights have been read."""
        return sorted(set(self.gate.touched()) | set(self.up.touched()) | set(self.down.touched()))


def route(logits: np.ndarray, k: int, norm_weights: bool) -> tuple[np.ndarray, np.ndarray]:
    """logits (t, n_expert) -> the chosen experts (t, k) int64, most probable first, and their weights (t, k)
    float32: softmax probabilities, renormalised over the k where norm_weights (llama.cpp's norm_w)."""
    logits = logits.astype(np.float32, copy=False)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))  # (t, n_expert)
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]  # (t, k)
    w = np.take_along_axis(p, ids, axis=1)  # (t, k)
    if norm_weights:
        w = w / w.sum(axis=1, keepdims=True)
    return ids, w.astype(np.float32, copy=False)


def by_expert(ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The chosen experts ids (t, k) grouped by expert: (e, tokens (n_e,), slots (n_e,)) for each expert some
    token chose, in expert order; slot s is token s // k's choice s % k (an index into ids.ravel()). A token
    chooses an expert once, so an expert's tokens are distinct."""
    k = ids.shape[1]
    flat = ids.ravel()  # (t·k,)
    order = np.argsort(flat, kind="stable")  # slots grouped by expert
    experts, starts = np.unique(flat[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    return [(e, order[s0:s1] // k, order[s0:s1]) for e, s0, s1 in zip(experts.tolist(), starts, ends, strict=True)]


def router_ffn(h: np.ndarray, ffn: RouterFfn, out: np.ndarray | None = None) -> np.ndarray:
    """h (t, d) float32 -> (t, d) float32, into out where given: each token through its chosen experts.

    Tokens are grouped by expert, so a pass reads each chosen expert's three matrices once (one product over all
    the tokens that chose it), and no expert that no token chose. Products are the kernels' own (`matmul`,
    int8 activations for packed types, `float_products()` respected), row by row for the float types
    (`rowwise`), so a token's result, and so its choice of experts, does not depend on the other tokens of the
    pass: a prompt evaluated whole or token by token routes alike.
    """
    t = h.shape[0]
    h = np.ascontiguousarray(h, dtype=np.float32)
    ids, weights = route(matmul(ffn.router, h, rowwise=True), ffn.n_used, ffn.norm_weights)  # (t, k) each
    if out is None:
        out = np.zeros((t, ffn.down.rows), dtype=np.float32)
    else:
        out[...] = 0.0
    if t == 1 or float_products_active() or not _packed_experts(h, ffn, ids, weights, out):
        _expert_by_expert(h, ffn, ids, weights, out)
    _shared_expert(h, ffn, out)
    return out


def _expert_by_expert(h: np.ndarray, ffn: RouterFfn, ids: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """The experts' share of `router_ffn`, one chosen expert at a time: out (t, d) += each token's weighted sum
    of its experts' outputs."""
    for e, tokens, slots in by_expert(ids):
        xe = h[tokens]  # (n_e, d)
        if len(tokens) == 1:  # decode: gate and up in one parallel launch, as the dense FFN's
            g, u = (a[None] for a in matvec_many([ffn.gate.expert(e), ffn.up.expert(e)], xe[0]))
        else:
            g = matmul(ffn.gate.expert(e), xe, rowwise=True)  # (n_e, d_ff_exp)
            u = matmul(ffn.up.expert(e), xe, rowwise=True)  # (n_e, d_ff_exp)
        y = matmul(ffn.down.expert(e), swiglu(g, u, out=g), rowwise=True)  # (n_e, d)
        out[tokens] += weights.ravel()[slots, None] * y


def _packed_experts(h: np.ndarray, ffn: RouterFfn, ids: np.ndarray, weights: np.ndarray, out: np.ndarray) -> bool:
    """The experts' share of `router_ffn` for a pass of packed experts, in three launches (kernels/experts.py):
    out (t, d) = each token's weighted sum of its experts' outputs. False (nothing done) where some expert
    tensor is not of a packed type."""
    t, k = ids.shape
    order = np.argsort(ids.ravel(), kind="stable")  # (t·k,) slots grouped by expert, as by_expert groups them
    chosen, starts = np.unique(ids.ravel()[order], return_index=True)
    arenas = [tensor.packed_arena(chosen) for tensor in (ffn.gate, ffn.up, ffn.down)]
    if any(a is None for a in arenas):
        return False
    (gate_q, gate_s), (up_q, up_s), (down_q, down_s) = arenas  # type: ignore[misc]
    starts = np.append(starts, len(order)).astype(np.int64)  # (m + 1,) segment i: slots starts[i]..starts[i+1]
    chosen = chosen.astype(np.int64)
    codes = [BLOCK_CODES[tensor.ggml_type] for tensor in (ffn.gate, ffn.up, ffn.down)]
    tags = [tag(code) for code in codes]
    paired = [bool(packed.PAIRED[code]) for code in codes]  # the format's kernels read byte pairs (and so xq2)
    n_slots = len(order)
    # gate and up: the tokens' rows, in slot order
    x = experts.slot_buffers(n_slots, h.shape[1], paired[0] or paired[1])
    experts.quantize_slots(h, order // k, paired[0] or paired[1], *x)
    g = np.empty((n_slots, ffn.gate.rows), dtype=np.float32)  # (t·k, d_ff_exp)
    u = np.empty((n_slots, ffn.up.rows), dtype=np.float32)
    experts.experts_matmul(gate_q, gate_s, tags[0], chosen, starts, x[0], x[3], x[1], x[2], g)
    experts.experts_matmul(up_q, up_s, tags[1], chosen, starts, x[0], x[3], x[1], x[2], u)
    act = swiglu(g, u, out=g)  # (t·k, d_ff_exp)
    a = experts.slot_buffers(n_slots, act.shape[1], paired[2])
    experts.quantize_slots(act, np.arange(n_slots), paired[2], *a)
    y = np.empty((n_slots, ffn.down.rows), dtype=np.float32)  # (t·k, d)
    experts.experts_matmul(down_q, down_s, tags[2], chosen, starts, a[0], a[3], a[1], a[2], y)
    position = np.empty(n_slots, dtype=np.int64)
    position[order] = np.arange(n_slots)
    slots = np.sort(position.reshape(t, k), axis=1)  # (t, k) each token's slots, ascending expert
    token_weights = np.take_along_axis(weights, np.argsort(position.reshape(t, k), axis=1), axis=1)
    experts.weighted_sum(y, slots, np.ascontiguousarray(token_weights), out)
    return True


def _shared_expert(h: np.ndarray, ffn: RouterFfn, out: np.ndarray) -> None:
    """out += the shared expert's output, gated where the family gates it."""
    if ffn.shared is not None:
        gate, up, down, gate_inp = ffn.shared
        g = matmul(gate, h, rowwise=True)  # (t, d_ff_shexp)
        u = matmul(up, h, rowwise=True)
        y = matmul(down, swiglu(g, u, out=g), rowwise=True)  # (t, d)
        if gate_inp is None:  # Granite's: ungated
            out += y
        else:
            s = matmul(gate_inp, h, rowwise=True)  # (t, 1)
            out += y / (1.0 + np.exp(-s))  # sigmoid-gated, as llama.cpp's silu(s) / s
