"""Model hyper-parameters, read once from GGUF metadata, with the family's description (engine/families.py)
resolved against them: every constant and per-layer choice an execution path needs is a field here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ModelFileError, UnsupportedModelError
from .families import FAMILIES, Family
from .rope import Yarn

# A prompt is evaluated in chunks of at most this many tokens (bounds scratch memory: scores are heads × chunk ×
# ctx); a sliding-window layer's ring cache holds its window plus one chunk, so a chunk never overwrites keys
# that one of its own queries still reads.
PREFILL_CHUNK = 256

MAX_SIZE = 1 << 24  # any count or width in a model's metadata is below this, or the file is refused

# rope.scaling.type values we run; any other (longrope, su, ...) is refused by name.
_ROPE_SCALINGS = (None, "none", "linear", "yarn")


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
    spec: Family  # the family's description (engine/families.py)
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
    rope_scale: float  # linear position scaling of the global layers (1.0: none): 1/rope.scaling.factor
    rope_yarn: Yarn | None  # YaRN's corrections on top of rope_scale (rope.scaling.type yarn); None: none
    rope_base_local: float  # RoPE base of the sliding-window layers
    rope_scale_local: float  # and their position scaling
    attn_scale: float  # multiplies q·k (1/√head_dim unless the family says otherwise)
    attn_softcap: float  # scores become cap·tanh(scores / cap) before the softmax; 0: none
    final_softcap: float  # the same on the output logits; 0: none
    embed_scale: float  # token embeddings are multiplied by this (1.0: none)
    sliding_window: int  # keys a local layer's query sees, itself included; 0: no local layers
    local: tuple[bool, ...]  # per layer: attends over the sliding window only
    n_expert: int = 0  # experts per MoE layer (expert_count); 0: a dense FFN
    n_expert_used: int = 0  # experts each token runs (expert_used_count, the router's top-k)
    d_ff_exp: int = 0  # hidden width of one expert's FFN (expert_feed_forward_length)
    d_ff_shexp: int = 0  # hidden width of the shared expert (expert_shared_feed_forward_length); 0: none
    residual_scale: float = 1.0  # each branch's output is multiplied by this before its residual (granite)
    logit_scale: float = 1.0  # the output logits are divided by this (granite)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], n_vocab: int) -> ModelConfig:
        arch = meta.get("general.architecture")
        if arch not in FAMILIES:
            known = ", ".join(sorted(FAMILIES))
            raise UnsupportedModelError(f"architecture {arch!r} is not supported (supported: {known})")
        spec = FAMILIES[arch]

        def key(name: str, kind: type = int, default: Any = None) -> Any:
            return _get(meta, f"{arch}.{name}", kind, default)

        d_model = key("embedding_length")
        n_head = key("attention.head_count")
        n_kv_head = key("attention.head_count_kv", int, n_head)
        head_dim = key("attention.key_length", int, d_model // n_head if n_head > 0 else 0)
        eps_key = "attention.layer_norm_rms_epsilon" if spec.norm == "rms" else "attention.layer_norm_epsilon"
        scaling = meta.get(f"{arch}.rope.scaling.type")
        if scaling not in _ROPE_SCALINGS:
            raise UnsupportedModelError(
                f"metadata {arch}.rope.scaling.type: {scaling!r:.40} rope scaling is not supported"
            )
        rope_scale, yarn = 1.0, None
        if scaling in ("linear", "yarn"):
            factor = float(key("rope.scaling.factor", float, 1.0) or 1.0)  # as llama.cpp: 0 means none
            if not (math.isfinite(factor) and factor > 0):
                raise ModelFileError(f"metadata {arch}.rope.scaling.factor: {factor} is not a positive number")
            rope_scale = 1.0 / factor
        if scaling == "yarn":
            log_mul = float(key("rope.scaling.yarn_log_multiplier", float, 0.0))
            if log_mul:
                raise UnsupportedModelError(
                    f"metadata {arch}.rope.scaling.yarn_log_multiplier: {log_mul} (DeepSeek's YaRN) is not supported"
                )
            ctx_orig = key("rope.scaling.original_context_length", int, 0) or key("context_length")
            attn_factor = float(key("rope.scaling.attn_factor", float, 1.0))
            if not (0 < ctx_orig < MAX_SIZE and math.isfinite(attn_factor)):
                raise ModelFileError(
                    f"metadata {arch}.rope.scaling: original_context_length {ctx_orig}, attn_factor {attn_factor}"
                    " are not sane"
                )
            yarn = Yarn(factor=factor, ctx_orig=ctx_orig, attn_factor=attn_factor)
        experts = meta.get(f"{arch}.expert_count", 0)
        if not spec.moe and isinstance(experts, int) and experts > 0:
            raise UnsupportedModelError(
                f"metadata {arch}.expert_count: {experts} experts (mixture of experts) is not supported"
            )
        moe = (key("expert_count"), key("expert_used_count"), key(spec.expert_width_key)) if spec.moe else ()
        if spec.shared_expert:  # a plain shared expert exists only where the file gives its width
            default = key("feed_forward_length") if spec.shared_expert == "gated" else 0
            moe += (key("expert_shared_feed_forward_length", int, default),)
        value_dim = key("attention.value_length", int, head_dim)
        if value_dim != head_dim:
            raise UnsupportedModelError(
                f"metadata {arch}.attention.value_length: {value_dim} differs from key_length {head_dim} "
                "(not supported)"
            )
        n_layer = key("block_count")
        # Flags per layer are built here, before _check: over a size it refuses (a fuzzed 2**40), none at all.
        layers = range(n_layer) if 0 < n_layer < MAX_SIZE else range(0)
        rope_base = float(key("rope.freq_base", float, 10000.0))
        # As llama.cpp: a file without a sliding window runs every layer global.
        window = max(0, key("attention.sliding_window", int, 0)) if spec.swa_period else 0
        period = spec.swa_period if window else 0
        local = tuple(bool(period) and i % period != period - 1 for i in layers)
        base_local = float(key("rope.freq_base_swa", float, spec.local_rope_base or rope_base))
        wide = spec.wide_scale_layers and n_layer == spec.wide_scale_layers
        width = d_model / n_head if wide and n_head > 0 else head_dim
        attn_scale = 1.0 / math.sqrt(width) if width > 0 else 0.0  # a size that is not positive is refused below
        granite = (1.0, 1.0, 1.0)  # embedding, residual, logit scales
        if spec.granite_scales:  # llama.cpp: a missing or zero attention.scale keeps 1/√head_dim
            attn_scale = float(key("attention.scale", float, 0.0)) or attn_scale
            names = ("embedding_scale", "residual_scale", "logit_scale")
            embedding, residual, logit = (float(key(k, float, 1.0)) for k in names)
            granite = (embedding, residual, logit)
            if not all(math.isfinite(v) and v > 0 for v in (*granite, attn_scale)):
                raise ModelFileError(f"metadata {arch}: scales {granite} or attention.scale {attn_scale} not sane")
        softcaps = (0.0, 0.0)
        if spec.softcap:
            softcaps = (
                float(key("attn_logit_softcapping", float, 50.0)),
                float(key("final_logit_softcapping", float, 30.0)),
            )
        cfg = cls(
            arch=arch,
            spec=spec,
            n_vocab=n_vocab,
            d_model=d_model,
            n_layer=n_layer,
            n_head=n_head,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            d_ff=key("feed_forward_length"),
            n_ctx_train=key("context_length"),
            norm_eps=float(key(eps_key, float, 1e-5)),
            rope_base=rope_base,
            rope_dim=key("rope.dimension_count", int, head_dim),
            rope_scale=rope_scale,
            rope_yarn=yarn,
            rope_base_local=base_local,
            rope_scale_local=1.0 if spec.local_rope_base else rope_scale,
            attn_scale=attn_scale,
            attn_softcap=softcaps[0],
            final_softcap=softcaps[1],
            embed_scale=float(np.float32(math.sqrt(d_model))) if spec.embed_scale else granite[0],
            residual_scale=granite[1],
            logit_scale=granite[2],
            sliding_window=window,
            local=local,
            **dict(zip(("n_expert", "n_expert_used", "d_ff_exp", "d_ff_shexp"), moe, strict=False)),
        )
        cfg._check()
        return cfg

    def _check(self) -> None:
        positive = ("n_vocab", "d_model", "n_layer", "n_head", "n_kv_head", "head_dim", "d_ff", "n_ctx_train")
        for name in positive:
            value = getattr(self, name)
            if not 0 < value < MAX_SIZE:
                raise ModelFileError(f"metadata {self.arch}: {name} = {value} is not a sane size")
        if self.spec.moe:
            shared = ("d_ff_shexp",) if self.spec.shared_expert == "gated" or self.d_ff_shexp else ()
            for name in ("n_expert", "n_expert_used", "d_ff_exp", *shared):
                if not 0 < getattr(self, name) < MAX_SIZE:
                    raise ModelFileError(f"metadata {self.arch}: {name} = {getattr(self, name)} is not a sane size")
            if self.n_expert_used > self.n_expert:
                raise ModelFileError(
                    f"metadata {self.arch}: expert_used_count {self.n_expert_used} exceeds expert_count {self.n_expert}"
                )
        if self.n_head % self.n_kv_head:
            raise ModelFileError(
                f"metadata {self.arch}: head_count {self.n_head} is not a multiple of head_count_kv {self.n_kv_head}"
            )
        if self.spec.positions == "rope" and (self.rope_dim > self.head_dim or self.rope_dim % 2):
            raise ModelFileError(f"metadata {self.arch}: rope.dimension_count {self.rope_dim} does not fit the heads")
        if self.spec.positions == "rope" and not (math.isfinite(self.rope_base) and self.rope_base > 0):
            raise ModelFileError(f"metadata {self.arch}: rope.freq_base {self.rope_base} is not a positive number")
        for name in ("attn_softcap", "final_softcap"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ModelFileError(f"metadata {self.arch}: {name} {getattr(self, name)} is not a number >= 0")
        if not (math.isfinite(self.norm_eps) and self.norm_eps >= 0):
            raise ModelFileError(f"metadata {self.arch}: norm epsilon {self.norm_eps} is not a number >= 0")

    def cache_rows(self, layer: int, n_ctx: int) -> int:
        """Positions layer `layer`'s KV cache holds for a context of n_ctx: all of them, or for a sliding-window
        layer a ring of its window plus one prompt chunk (position p in row p % rows)."""
        if self.local[layer]:
            return min(n_ctx, self.sliding_window + PREFILL_CHUNK)
        return n_ctx

    def window(self, layer: int) -> int:
        """Keys a query of layer `layer` sees, itself included; 0: every earlier position."""
        return self.sliding_window if self.local[layer] else 0

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
            if self.spec.qk_norm:  # per head, or over every head's values at once (qk_norm_rows)
                out[p + "attn_q_norm.weight"] = ((q_dim if self.spec.qk_norm_rows else hd,), True)
                out[p + "attn_k_norm.weight"] = ((kv_dim if self.spec.qk_norm_rows else hd,), True)
            if self.spec.post_norms:
                out[p + "post_attention_norm.weight"] = ((d,), True)
                out[p + "post_ffw_norm.weight"] = ((d,), True)
            out[p + "attn_output.weight"] = ((q_dim, d), True)
            if self.spec.moe:  # ggml order: the expert index is the last (slowest) dimension
                fe, ne = self.d_ff_exp, self.n_expert
                out[p + "ffn_gate_inp.weight"] = ((d, ne), True)
                out[p + "ffn_gate_exps.weight"] = ((d, fe, ne), True)
                out[p + "ffn_up_exps.weight"] = ((d, fe, ne), True)
                out[p + "ffn_down_exps.weight"] = ((fe, d, ne), True)
                if self.d_ff_shexp:
                    fs = self.d_ff_shexp
                    if self.spec.shared_expert == "gated":
                        out[p + "ffn_gate_inp_shexp.weight"] = ((d,), True)
                    out[p + "ffn_gate_shexp.weight"] = ((d, fs), True)
                    out[p + "ffn_up_shexp.weight"] = ((d, fs), True)
                    out[p + "ffn_down_shexp.weight"] = ((fs, d), True)
            else:
                if self.spec.ffn != "gelu":
                    out[p + "ffn_gate.weight"] = ((d, ff), True)
                out[p + "ffn_up.weight"] = ((d, ff), True)
                out[p + "ffn_down.weight"] = ((ff, d), True)
            if self.spec.biases:
                out[p + "attn_output.bias"] = ((d,), True)
                out[p + "ffn_up.bias"] = ((ff,), True)
                out[p + "ffn_down.bias"] = ((d,), True)
        return out
