"""Tiny GGUF models of each architecture, written with gguf.GGUFWriter, and an independent NumPy forward pass.

The reference reads the same weights as float64 and computes attention from scratch for every position, with
no KV cache, no chunking and no shared code with engine/ (it states each family's differences itself, from the
published model definitions, rather than reading engine/families.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: 256 bytes, a few merges, two control tokens."""
    tokens = bytes_to_unicode()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "a t", "e n"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    types = [1] * len(tokens)
    for special in ("<|endoftext|>", "<|im_end|>"):
        tokens.append(special)
        types.append(3)
    return tokens, merges, types


@dataclass
class TinyModel:
    arch: str  # the family; "llama3" is a llama file with Llama 3's rope_freqs.weight
    path: Path
    n_vocab: int
    d: int
    n_head: int
    n_kv: int
    n_layer: int
    d_ff: int
    n_ctx: int
    eps: float
    rope_base: float = 10000.0
    head_dim: int = 0  # 0: d / n_head
    window: int = 0  # sliding window of the local layers (gemma2, gemma3); 0: none
    attn_softcap: float = 0.0  # gemma2
    final_softcap: float = 0.0
    yarn: tuple[float, int, float] | None = None  # YaRN's (factor, original_context_length, attn_factor)
    n_expert: int = 0  # qwen3moe, olmoe: experts per layer, each token running n_expert_used of them
    n_expert_used: int = 0
    d_ff_exp: int = 0
    d_ff_shexp: int = 0  # qwen2moe, granitemoeshared: the shared expert's width
    granite: tuple[float, float, float, float] | None = None  # embedding, residual, attention, logit scales
    w: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float64 values as stored (numpy order)

    @property
    def hd(self) -> int:
        return self.head_dim or self.d // self.n_head

    def is_local(self, layer: int) -> bool:
        """Gemma 2: even layers slide; Gemma 3: five of every six."""
        if not self.window:
            return False
        return layer % 2 == 0 if self.arch == "gemma2" else layer % 6 != 5


# Per-family shape of the tiny models: head_dim that differs from d / n_head where the family allows it, six
# layers for Gemma 3 so that its one global layer in six exists, small windows so that short texts exceed them,
# and soft-caps small enough to bite on these weights.
_SHAPES = {
    "qwen3": {"head_dim": 32},
    # Qwen3-30B-A3B's router in miniature: 8 experts, 2 used, each a narrow SwiGLU FFN.
    "qwen3moe": {"head_dim": 32, "n_expert": 8, "n_expert_used": 2, "d_ff_exp": 64},
    # OLMoE's q/k norms span the whole rows, which llama.cpp sizes n_embd for k too: as many kv heads as heads.
    # Qwen1.5-MoE's: 8 experts, 2 used, not renormalised, plus a shared expert of its own width.
    "qwen2moe": {"n_expert": 8, "n_expert_used": 2, "d_ff_exp": 64, "d_ff_shexp": 96},
    # Granite 3 MoE's multipliers, of the size its files carry (embedding 12, residual 0.22, attention 1/64),
    # logit_scale 0.5 so that it bites; experts d_ff wide.
    "granitemoe": {"n_expert": 8, "n_expert_used": 2, "d_ff_exp": 64, "d_ff": 64,
                   "granite": (12.0, 0.22, 0.015625, 0.5)},
    "olmoe": {"n_kv": 4, "n_expert": 8, "n_expert_used": 2, "d_ff_exp": 64, "d_ff": 64},  # experts: d_ff wide
    "gemma2": {"head_dim": 32, "window": 5, "attn_softcap": 1.5, "final_softcap": 6.0},
    "gemma3": {"head_dim": 32, "window": 5, "n_layer": 6, "rope_base": 1e6},
}
# Granite MoE with a shared expert (HF's granitemoeshared, a granitemoe GGUF): ungated, of its own width.
_SHAPES["granitemoeshared"] = {**_SHAPES["granitemoe"], "d_ff_shexp": 96}
GEMMA = ("gemma2", "gemma3")
# Variants written under another family's GGUF architecture.
GGUF_ARCH = {"llama3": "llama", "granitemoeshared": "granitemoe"}
RENORMALISED = ("qwen3moe", "granitemoe", "granitemoeshared")  # the chosen experts' weights sum to 1


def write_tiny_model(
    path: Path, arch: str, seed: int = 0, matrix_type: T = T.Q8_0, drop: tuple[str, ...] = (), tied: bool = False,
    n_ctx: int = 128, extra: dict | None = None, yarn: tuple[float, int, float] | None = None,
) -> TinyModel:  # fmt: skip
    """Write a small model of `arch` to `path`; matrices in `matrix_type`, norms/biases in F32. `extra`: more
    metadata, {key without the arch prefix: value}; `yarn`: YaRN rope scaling (factor, original context,
    attention factor)."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = tiny_vocab()
    n_vocab = len(tokens)
    shape = dict(_SHAPES.get(arch, {}))
    m = TinyModel(arch, path, n_vocab, d=64, n_head=4, n_kv=shape.pop("n_kv", 2 if arch != "gpt2" else 4),
                  n_layer=shape.pop("n_layer", 2), d_ff=shape.pop("d_ff", 128), n_ctx=n_ctx, eps=1e-5, yarn=yarn,
                  **shape)  # fmt: skip
    hd = m.hd
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH.get(arch, arch))
    writer.add_context_length(m.n_ctx)
    writer.add_embedding_length(m.d)
    writer.add_block_count(m.n_layer)
    writer.add_feed_forward_length(m.d_ff)
    writer.add_head_count(m.n_head)
    writer.add_head_count_kv(m.n_kv)
    if arch == "gpt2":
        writer.add_layer_norm_eps(m.eps)
    else:
        writer.add_layer_norm_rms_eps(m.eps)
        writer.add_rope_freq_base(m.rope_base)
        writer.add_rope_dimension_count(hd)
    if m.head_dim:
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    if m.window:
        writer.add_sliding_window(m.window)
    if m.n_expert:
        writer.add_expert_count(m.n_expert)
        writer.add_expert_used_count(m.n_expert_used)
        if arch not in ("olmoe", "granitemoe", "granitemoeshared"):  # experts feed_forward_length wide, the key read
            writer.add_expert_feed_forward_length(m.d_ff_exp)
        if m.d_ff_shexp:
            writer.add_expert_shared_feed_forward_length(m.d_ff_shexp)
    if m.granite:
        writer.add_embedding_scale(m.granite[0])
        writer.add_residual_scale(m.granite[1])
        writer.add_attention_scale(m.granite[2])
        writer.add_logit_scale(m.granite[3])
    if m.attn_softcap:
        writer.add_attn_logit_softcapping(m.attn_softcap)
        writer.add_final_logit_softcapping(m.final_softcap)
    if yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn[0])
        writer.add_rope_scaling_orig_ctx_len(yarn[1])
        writer.add_rope_scaling_attn_factors(yarn[2])
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(f"{GGUF_ARCH.get(arch, arch)}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{GGUF_ARCH.get(arch, arch)}.{key}", value)
        else:
            writer.add_uint32(f"{GGUF_ARCH.get(arch, arch)}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_eos_token_id(n_vocab - 2)
    writer.add_bos_token_id(n_vocab - 2)

    def matrix(name: str, rows: int, cols: int, experts: int = 0, kind: T = matrix_type) -> None:
        shape = (experts, rows, cols) if experts else (rows, cols)  # experts: one 3-D tensor of them
        a = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if kind == T.F32:
            m.w[name] = a.astype(np.float64)
            data = a
            writer_args = {}
        else:
            data = gguf.quants.quantize(a, kind)
            m.w[name] = gguf.quants.dequantize(data, kind).reshape(shape).astype(np.float64)
            writer_args = {"raw_dtype": kind}
        if name not in drop:
            writer.add_tensor(name, data, **writer_args)

    def vector(name: str, n: int, center: float) -> None:
        a = (center + rng.standard_normal(n) * 0.1).astype(np.float32)
        m.w[name] = a.astype(np.float64)
        if name not in drop:
            writer.add_tensor(name, a)

    matrix("token_embd.weight", n_vocab, m.d)
    if arch in GEMMA:  # Gemma's output is the embedding, always
        tied = True
    if arch == "gpt2":
        matrix("position_embd.weight", m.n_ctx, m.d)
    if arch == "llama3":  # frequency divisors, 1 for the fast dims up to 8 for the slow ones, as Llama 3.1's
        m.w["rope_freqs.weight"] = np.linspace(1.0, 8.0, hd // 2).astype(np.float32).astype(np.float64)
        writer.add_tensor("rope_freqs.weight", m.w["rope_freqs.weight"].astype(np.float32))
    vector("output_norm.weight", m.d, 1.0)
    if arch == "gpt2":
        vector("output_norm.bias", m.d, 0.0)
    if not tied:
        matrix("output.weight", n_vocab, m.d)
    for i in range(m.n_layer):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", m.d, 1.0)
        vector(p + "ffn_norm.weight", m.d, 1.0)
        if arch == "gpt2":
            vector(p + "attn_norm.bias", m.d, 0.0)
            vector(p + "ffn_norm.bias", m.d, 0.0)
            matrix(p + "attn_qkv.weight", 3 * m.d, m.d)
            vector(p + "attn_qkv.bias", 3 * m.d, 0.0)
            vector(p + "attn_output.bias", m.d, 0.0)
            vector(p + "ffn_up.bias", m.d_ff, 0.0)
            vector(p + "ffn_down.bias", m.d, 0.0)
        else:
            matrix(p + "attn_q.weight", m.n_head * hd, m.d)
            matrix(p + "attn_k.weight", m.n_kv * hd, m.d)
            matrix(p + "attn_v.weight", m.n_kv * hd, m.d)
            if m.n_expert:  # the router stays F32, as llama.cpp's quantizer leaves ffn_gate_inp
                matrix(p + "ffn_gate_inp.weight", m.n_expert, m.d, kind=T.F32)
                matrix(p + "ffn_gate_exps.weight", m.d_ff_exp, m.d, m.n_expert)
                matrix(p + "ffn_up_exps.weight", m.d_ff_exp, m.d, m.n_expert)
                matrix(p + "ffn_down_exps.weight", m.d, m.d_ff_exp, m.n_expert)
                if m.d_ff_shexp:
                    if arch == "qwen2moe":  # Granite's shared expert has no gate
                        vector(p + "ffn_gate_inp_shexp.weight", m.d, 0.0)
                    matrix(p + "ffn_gate_shexp.weight", m.d_ff_shexp, m.d)
                    matrix(p + "ffn_up_shexp.weight", m.d_ff_shexp, m.d)
                    matrix(p + "ffn_down_shexp.weight", m.d, m.d_ff_shexp)
            else:
                matrix(p + "ffn_gate.weight", m.d_ff, m.d)
            if arch in ("qwen3", "qwen3moe", "gemma3"):
                vector(p + "attn_q_norm.weight", hd, 1.0)
                vector(p + "attn_k_norm.weight", hd, 1.0)
            if arch == "olmoe":  # over the whole rows
                vector(p + "attn_q_norm.weight", m.n_head * hd, 1.0)
                vector(p + "attn_k_norm.weight", m.n_kv * hd, 1.0)
            if arch in GEMMA:
                vector(p + "post_attention_norm.weight", m.d, 1.0)
                vector(p + "post_ffw_norm.weight", m.d, 1.0)
            if arch in ("qwen2", "qwen2moe"):
                vector(p + "attn_q.bias", m.n_head * hd, 0.0)
                vector(p + "attn_k.bias", m.n_kv * hd, 0.0)
                vector(p + "attn_v.bias", m.n_kv * hd, 0.0)
        matrix(p + "attn_output.weight", m.d, m.n_head * hd)
        if not m.n_expert:
            matrix(p + "ffn_up.weight", m.d_ff, m.d)
            matrix(p + "ffn_down.weight", m.d, m.d_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return m


def rope_angle(
    pos: int, i: int, n_dims: int, base: float, freq_factor: float = 1.0, yarn: tuple[float, int, float] | None = None
) -> tuple[float, float]:  # fmt: skip
    """(angle, magnitude) of rotation pair i at position pos, written from llama.cpp's ggml-cpu `rope_yarn`,
    `rope_yarn_ramp` and `ggml_rope_yarn_corr_dims` and llama_context's yarn_attn_factor, for one value at a
    time. yarn: (factor, original context, rope.scaling.attn_factor); None: no scaling."""
    theta_extrap = pos * base ** (-2.0 * i / n_dims) / freq_factor
    if yarn is None:
        return theta_extrap, 1.0
    factor, n_ctx_orig, rope_attn_factor = yarn
    freq_scale = 1.0 / factor
    beta_fast, beta_slow, ext_factor = 32.0, 1.0, 1.0  # ggml's defaults; ext_factor 1 for a yarn file

    def corr_dim(n_rot: float) -> float:
        return n_dims * np.log(n_ctx_orig / (n_rot * 2 * np.pi)) / (2 * np.log(base))

    low = max(0.0, np.floor(corr_dim(beta_fast)))
    high = min(n_dims - 1.0, np.ceil(corr_dim(beta_slow)))
    ramp = 1 - min(1.0, max(0.0, ((2 * i) // 2 - low) / max(0.001, high - low)))
    theta_interp = freq_scale * theta_extrap
    ramp_mix = ramp * ext_factor
    theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
    get_mscale = 1.0 if factor <= 1 else 0.1 * np.log(factor) + 1.0
    attn_factor = get_mscale / (1.0 + 0.1 * np.log(factor)) * rope_attn_factor  # llama_context's
    mscale = attn_factor * (1.0 + 0.1 * np.log(1.0 / freq_scale))  # ggml multiplies its own back in
    return theta, mscale


def reference_logits(m: TinyModel, ids: list[int], router_gaps: np.ndarray | None = None) -> np.ndarray:
    """Float64 logits (len(ids), n_vocab), every position attending to all earlier ones, recomputed.
    router_gaps (len(ids),), where given: set to each token's smallest margin, over the layers, between the last
    expert chosen and the first not chosen (router logits), where int8 rounding elsewhere can flip the choice."""
    w = m.w
    hd = m.hd
    group = m.n_head // m.n_kv
    x = w["token_embd.weight"][ids]  # (t, d)
    t = len(ids)
    if m.arch == "gpt2":
        x = x + w["position_embd.weight"][:t]
    if m.arch in GEMMA:
        x = x * np.sqrt(m.d)
    embed, residual, attn_scale, logit_scale = m.granite or (1.0, 1.0, 1 / np.sqrt(hd), 1.0)
    x = x * embed
    neox = m.arch in ("qwen2", "qwen3", "qwen3moe", "olmoe", "qwen2moe", *GEMMA)

    def gelu(u: np.ndarray) -> np.ndarray:
        return 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))

    def rms(v: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + m.eps) * weight

    def norm(v: np.ndarray, name: str) -> np.ndarray:
        if m.arch == "gpt2":
            mu = v.mean(-1, keepdims=True)
            var = ((v - mu) ** 2).mean(-1, keepdims=True)
            return (v - mu) / np.sqrt(var + m.eps) * w[name + ".weight"] + w[name + ".bias"]
        return rms(v, w[name + ".weight"])

    def rotate(v: np.ndarray, base: float) -> np.ndarray:  # v (t, heads, hd)
        out = v.copy()
        for pos in range(t):
            for i in range(hd // 2):
                freq_factor = w.get("rope_freqs.weight", np.ones(hd))[i]
                angle, mag = rope_angle(pos, i, hd, base, freq_factor, m.yarn)
                c, s = np.cos(angle) * mag, np.sin(angle) * mag
                a, b = (i, i + hd // 2) if neox else (2 * i, 2 * i + 1)
                out[pos, :, a] = v[pos, :, a] * c - v[pos, :, b] * s
                out[pos, :, b] = v[pos, :, a] * s + v[pos, :, b] * c
        return out

    for i in range(m.n_layer):
        p = f"blk.{i}."
        h = norm(x, p + "attn_norm")
        if m.arch == "gpt2":
            qkv = h @ w[p + "attn_qkv.weight"].T + w[p + "attn_qkv.bias"]
            q, k, v = qkv[:, : m.d], qkv[:, m.d : 2 * m.d], qkv[:, 2 * m.d :]
        else:
            q, k, v = (h @ w[p + f"attn_{n}.weight"].T for n in "qkv")
            if m.arch in ("qwen2", "qwen2moe"):
                q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
            if m.arch == "olmoe":  # RMSNorm of each token's whole q and k rows, before the heads are split
                q, k = rms(q, w[p + "attn_q_norm.weight"]), rms(k, w[p + "attn_k_norm.weight"])
        q = q.reshape(t, m.n_head, hd)
        k = k.reshape(t, m.n_kv, hd)
        v = v.reshape(t, m.n_kv, hd)
        if m.arch in ("qwen3", "qwen3moe", "gemma3"):
            q, k = rms(q, w[p + "attn_q_norm.weight"]), rms(k, w[p + "attn_k_norm.weight"])
        local = m.is_local(i)
        if m.arch != "gpt2":
            base = 10000.0 if m.arch == "gemma3" and local else m.rope_base  # Gemma 3's local layers
            q, k = rotate(q, base), rotate(k, base)
        att = np.zeros((t, m.n_head, hd))
        for pos in range(t):
            lo = max(0, pos - m.window + 1) if local else 0  # the window: the last `window` positions
            for head in range(m.n_head):
                kv = head // group
                scores = k[lo : pos + 1, kv] @ q[pos, head] * attn_scale  # (pos+1-lo,)
                if m.attn_softcap:
                    scores = m.attn_softcap * np.tanh(scores / m.attn_softcap)
                p_att = np.exp(scores - scores.max())
                p_att /= p_att.sum()
                att[pos, head] = p_att @ v[lo : pos + 1, kv]
        o = att.reshape(t, m.n_head * hd) @ w[p + "attn_output.weight"].T
        if m.arch == "gpt2":
            o = o + w[p + "attn_output.bias"]
        if m.arch in GEMMA:
            o = norm(o, p + "post_attention_norm")
        x = x + residual * o
        h = norm(x, p + "ffn_norm")
        if m.arch == "gpt2":
            u = h @ w[p + "ffn_up.weight"].T + w[p + "ffn_up.bias"]
            u = gelu(u)
            f = u @ w[p + "ffn_down.weight"].T + w[p + "ffn_down.bias"]
        elif m.n_expert:
            f = moe_ffn(m, h, p, router_gaps)
        else:
            g = h @ w[p + "ffn_gate.weight"].T
            act = gelu(g) if m.arch in GEMMA else g / (1 + np.exp(-g))
            f = (act * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        if m.arch in GEMMA:
            f = norm(f, p + "post_ffw_norm")
        x = x + residual * f
    x = norm(x, "output_norm")
    out = w.get("output.weight") if "output.weight" in w else w["token_embd.weight"]
    logits = x @ out.T / logit_scale
    if m.final_softcap:
        logits = m.final_softcap * np.tanh(logits / m.final_softcap)
    return logits


def rewrite_model(src: Path, dst: Path, change_tensor) -> None:
    """Copy a GGUF, passing each tensor's (name, data) through `change_tensor` (returns the new data)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        writer.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, change_tensor(t.name, np.array(t.data)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def moe_ffn(m: TinyModel, h: np.ndarray, p: str, router_gaps: np.ndarray | None = None) -> np.ndarray:
    """Qwen3-MoE's sparse block (transformers' Qwen3MoeSparseMoeBlock, norm_topk_prob): h (t, d) float64 ->
    (t, d), token by token: softmax over the router's logits, the top n_expert_used experts, their
    probabilities renormalised to sum to 1 (not for OLMoE, whose norm_topk_prob is false), and the weighted sum
    of those experts' SwiGLU FFNs."""
    w = m.w
    out = np.zeros_like(h)
    for i, x in enumerate(h):
        logits = w[p + "ffn_gate_inp.weight"] @ x  # (n_expert,)
        prob = np.exp(logits - logits.max())
        prob /= prob.sum()
        top = np.argsort(-prob)[: m.n_expert_used]
        if router_gaps is not None:
            ranked = np.sort(logits)[::-1]  # (n_expert,)
            gap = ranked[m.n_expert_used - 1] - ranked[m.n_expert_used]
            router_gaps[i] = gap if p == "blk.0." else min(router_gaps[i], gap)
        chosen = prob[top] / prob[top].sum() if m.arch in RENORMALISED else prob[top]
        for e, weight in zip(top, chosen, strict=True):
            g = w[p + "ffn_gate_exps.weight"][e] @ x  # (d_ff_exp,)
            u = w[p + "ffn_up_exps.weight"][e] @ x
            out[i] += weight * (w[p + "ffn_down_exps.weight"][e] @ (g / (1 + np.exp(-g)) * u))
        if m.d_ff_shexp:  # the shared expert: Qwen2-MoE's gated by sigmoid(ffn_gate_inp_shexp · x), Granite's not
            g, u = w[p + "ffn_gate_shexp.weight"] @ x, w[p + "ffn_up_shexp.weight"] @ x  # (d_ff_shexp,)
            gate = 1 / (1 + np.exp(-(w[p + "ffn_gate_inp_shexp.weight"] @ x))) if m.arch == "qwen2moe" else 1.0
            out[i] += gate * (w[p + "ffn_down_shexp.weight"] @ (g / (1 + np.exp(-g)) * u))
    return out


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every key of `reader`'s file into `writer`, but the header's and the architecture (the writer has its own)."""
    for f in reader.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            writer.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
