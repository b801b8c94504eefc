"""Model hyper-parameters and per-architecture differences, read once from GGUF metadata.

Architectures are data: an `ArchSpec` says which norm, FFN, position scheme and biases a family uses, and one
forward pass (engine/model.py) reads it. Adding a llama-like family is a new table row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import ModelFileError, UnsupportedModelError


@dataclass(frozen=True)
class ArchSpec:
    norm: str  # "rms" (RMSNorm, weight only) or "layer" (LayerNorm with bias)
    ffn: str  # "swiglu" (gate, up, down) or "gelu" (up, down)
    positions: str  # "rope" or "learned" (a position_embd table)
    rope_neox: bool  # rotate (i, i + d/2) pairs; False: adjacent (2i, 2i+1) pairs as llama GGUFs expect
    qkv_bias: bool  # Q/K/V projections carry biases
    fused_qkv: bool  # one attn_qkv matrix (3·d rows) instead of attn_q/k/v
    biases: bool  # attention output and FFN matrices carry biases


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("rms", "swiglu", "rope", rope_neox=False, qkv_bias=False, fused_qkv=False, biases=False),
    "qwen2": ArchSpec("rms", "swiglu", "rope", rope_neox=True, qkv_bias=True, fused_qkv=False, biases=False),
    "gpt2": ArchSpec("layer", "gelu", "learned", rope_neox=False, qkv_bias=True, fused_qkv=True, biases=True),
}


def _get(meta: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ModelFileError(f"metadata {key} is missing")
    if kind is int and isinstance(value, bool) or not isinstance(value, kind if kind is not float else (int, float)):
        raise ModelFileError(f"metadata {key}: expected {kind.__name__}, file has {value!r:.60}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # general.architecture
    spec: ArchSpec
    n_vocab: int  # rows of token_embd
    d_model: int  # embedding width
    n_layer: int  # transformer blocks
    n_head: int  # query heads
    n_kv_head: int  # key/value heads (GQA when fewer than n_head)
    head_dim: int  # width of one head
    d_ff: int  # FFN hidden width
    n_ctx_train: int  # context the model was trained for
    norm_eps: float  # epsilon of RMSNorm / LayerNorm
    rope_base: float  # RoPE frequency base
    rope_dim: int  # leading dims of each head that RoPE rotates
    rope_scale: float  # linear position scaling (1.0: none)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], n_vocab: int) -> ModelConfig:
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            known = ", ".join(sorted(ARCHITECTURES))
            raise UnsupportedModelError(f"architecture {arch!r} is not supported (supported: {known})")
        spec = ARCHITECTURES[arch]

        def key(name: str, kind: type = int, default: Any = None) -> Any:
            return _get(meta, f"{arch}.{name}", kind, default)

        d_model = key("embedding_length")
        n_head = key("attention.head_count")
        n_kv_head = key("attention.head_count_kv", int, n_head)
        head_dim = key("attention.key_length", int, d_model // n_head if n_head > 0 else 0)
        eps_key = "attention.layer_norm_rms_epsilon" if spec.norm == "rms" else "attention.layer_norm_epsilon"
        scaling = meta.get(f"{arch}.rope.scaling.type")
        rope_scale = 1.0
        if scaling == "linear":
            rope_scale = 1.0 / float(key("rope.scaling.factor", float, 1.0) or 1.0)
        cfg = cls(
            arch=arch,
            spec=spec,
            n_vocab=n_vocab,
            d_model=d_model,
            n_layer=key("block_count"),
            n_head=n_head,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            d_ff=key("feed_forward_length"),
            n_ctx_train=key("context_length"),
            norm_eps=float(key(eps_key, float, 1e-5)),
            rope_base=float(key("rope.freq_base", float, 10000.0)),
            rope_dim=key("rope.dimension_count", int, head_dim),
            rope_scale=rope_scale,
        )
        cfg._check()
        return cfg

    def _check(self) -> None:
        positive = ("n_vocab", "d_model", "n_layer", "n_head", "n_kv_head", "head_dim", "d_ff", "n_ctx_train")
        for name in positive:
            value = getattr(self, name)
            if not 0 < value < 1 << 24:
                raise ModelFileError(f"metadata {self.arch}: {name} = {value} is not a sane size")
        if self.n_head % self.n_kv_head:
            raise ModelFileError(
                f"metadata {self.arch}: head_count {self.n_head} is not a multiple of head_count_kv {self.n_kv_head}"
            )
        if self.spec.positions == "rope" and (self.rope_dim > self.head_dim or self.rope_dim % 2):
            raise ModelFileError(f"metadata {self.arch}: rope.dimension_count {self.rope_dim} does not fit the heads")
        if self.spec.positions == "rope" and not (math.isfinite(self.rope_base) and self.rope_base > 0):
            raise ModelFileError(f"metadata {self.arch}: rope.freq_base {self.rope_base} is not a positive number")
        if not (math.isfinite(self.norm_eps) and self.norm_eps >= 0):
            raise ModelFileError(f"metadata {self.arch}: norm epsilon {self.norm_eps} is not a number >= 0")

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """Every tensor name the forward pass reads -> (ggml shape, required)."""
        d, hd, ff = self.d_model, self.head_dim, self.d_ff
        q_dim, kv_dim = self.n_head * hd, self.n_kv_head * hd
        out: dict[str, tuple[tuple[int, ...], bool]] = {
            "token_embd.weight": ((d, self.n_vocab), True),
            "output_norm.weight": ((d,), True),
            "output.weight": ((d, self.n_vocab), False),  # absent: tied to token_embd
        }
        if self.spec.norm == "layer":
            out["output_norm.bias"] = ((d,), True)
        if self.spec.positions == "learned":
            out["position_embd.weight"] = ((d, self.n_ctx_train), True)
        else:
            out["rope_freqs.weight"] = ((self.rope_dim // 2,), False)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out[p + "attn_norm.weight"] = ((d,), True)
            out[p + "ffn_norm.weight"] = ((d,), True)
            if self.spec.norm == "layer":
                out[p + "attn_norm.bias"] = ((d,), True)
                out[p + "ffn_norm.bias"] = ((d,), True)
            if self.spec.fused_qkv:
                out[p + "attn_qkv.weight"] = ((d, q_dim + 2 * kv_dim), True)
                if self.spec.qkv_bias:
                    out[p + "attn_qkv.bias"] = ((q_dim + 2 * kv_dim,), True)
            else:
                for name, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                    out[p + name + ".weight"] = ((d, rows), True)
                    if self.spec.qkv_bias:
                        out[p + name + ".bias"] = ((rows,), True)
            out[p + "attn_output.weight"] = ((q_dim, d), True)
            if self.spec.ffn == "swiglu":
                out[p + "ffn_gate.weight"] = ((d, ff), True)
            out[p + "ffn_up.weight"] = ((d, ff), True)
            out[p + "ffn_down.weight"] = ((ff, d), True)
            if self.spec.biases:
                out[p + "attn_output.bias"] = ((d,), True)
                out[p + "ffn_up.bias"] = ((ff,), True)
                out[p + "ffn_down.bias"] = ((d,), True)
        return out
