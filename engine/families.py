"""The model families the engine runs, each described once: this table is the only place a family is named.

A `Family` says what a layer is made of -- norms and where they sit, the attention variant, the FFN kind,
positions, scaling constants and which layers attend over a sliding window -- as llama.cpp's `src/models/*.cpp`
builders say it in the arguments they pass to shared ops. Its resolved form, `ModelConfig` (engine/config.py),
becomes each layer's `LayerSpec` (engine/layer.py), which every executor of the layer (the CPU prompt path, the
fused one-token step, the device offload) reads, and nothing else.

Adding a family is a row here, plus whatever operation it needs that no family has yet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    norm: str = "rms"  # "rms" (RMSNorm, weight only) or "layer" (LayerNorm with bias)
    ffn: str = "swiglu"  # "swiglu": silu(gate)·up; "geglu": gelu_tanh(gate)·up; "gelu": gelu(up), no gate
    positions: str = "rope"  # "rope" or "learned" (a position_embd table added to the embeddings)
    rope_neox: bool = False  # rotate (i, i + d/2) pairs; False: adjacent (2i, 2i+1) pairs as llama GGUFs expect
    qkv_bias: bool = False  # Q/K/V projections carry biases
    fused_qkv: bool = False  # one attn_qkv matrix (q_dim + 2·kv_dim rows) instead of attn_q/k/v
    biases: bool = False  # attention output and FFN matrices carry biases
    qk_norm: bool = False  # per-head RMSNorm of q and k (attn_q_norm, attn_k_norm) before RoPE
    qk_norm_rows: bool = False  # with qk_norm: one RMSNorm over each token's whole q and k rows, all heads (olmoe)
    post_norms: bool = False  # RMSNorm of each branch's output before its residual (post_attention/ffw_norm)
    embed_scale: bool = False  # token embeddings multiplied by √d
    softcap: bool = False  # tanh soft-capping of attention scores and final logits (from the file's caps)
    swa_period: int = 0  # layer i attends over the sliding window unless i % swa_period == swa_period - 1; 0: never
    local_rope_base: float = 0.0  # RoPE base of the sliding-window layers (0: the file's, as global layers)
    # Attention scale 1/√key_length, except at this block count (the 27B models), where llama.cpp takes
    # 1/√(d/n_head): the checkpoints' query_pre_attn_scalar, which GGUF does not carry. 0: always key_length.
    wide_scale_layers: int = 0
    # Mixture of experts: the FFN is a router (ffn_gate_inp) over expert_count experts stored as 3-D tensors
    # (ffn_gate_exps, ffn_up_exps, ffn_down_exps), each an FFN of kind `ffn`; each token runs the
    # expert_used_count experts of highest softmax probability (llama.cpp's build_moe_ffn, softmax gating).
    moe: bool = False
    moe_norm_weights: bool = False  # the chosen experts' probabilities are renormalised to sum to 1 (norm_w)
    expert_width_key: str = "expert_feed_forward_length"  # the metadata key of one expert's FFN width
    # A shared expert every token runs (ffn_{gate,up,down}_shexp, expert_shared_feed_forward_length wide), its
    # output added to the routed sum. "gated": in every layer (d_ff wide without the key), scaled by
    # sigmoid(ffn_gate_inp_shexp · h) (qwen2moe); "plain": only in files that give the key, ungated (Granite MoE
    # shared, llama.cpp's n_ff_shexp > 0); "": none.
    shared_expert: str = ""
    # Granite's multipliers, from the file: embeddings × embedding_scale, each branch's output × residual_scale
    # before its residual, attention scores × attention.scale (for 1/√head_dim), logits ÷ logit_scale.
    granite_scales: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(),  # Llama 2/3 (rope_freqs.weight for Llama 3's frequency factors), SmolLM2, TinyLlama
    "qwen2": Family(rope_neox=True, qkv_bias=True),
    "qwen3": Family(rope_neox=True, qk_norm=True),
    "qwen3moe": Family(rope_neox=True, qk_norm=True, moe=True, moe_norm_weights=True),  # Qwen3-30B-A3B, Coder
    "olmoe": Family(  # OLMoE-1B-7B: no renormalising; its experts are feed_forward_length wide
        rope_neox=True, qk_norm=True, qk_norm_rows=True, moe=True, expert_width_key="feed_forward_length"
    ),
    "qwen2moe": Family(rope_neox=True, qkv_bias=True, moe=True, shared_expert="gated"),  # Qwen1.5-MoE, Qwen2-57B-A14B
    "granitemoe": Family(  # Granite 3 MoE (and its "shared" variant): experts feed_forward_length wide, renormalised
        moe=True,
        moe_norm_weights=True,
        expert_width_key="feed_forward_length",
        granite_scales=True,
        shared_expert="plain",
    ),
    "gemma2": Family(
        ffn="geglu", rope_neox=True, post_norms=True, embed_scale=True, softcap=True, swa_period=2, wide_scale_layers=46
    ),
    "gemma3": Family(
        ffn="geglu",
        rope_neox=True,
        qk_norm=True,
        post_norms=True,
        embed_scale=True,
        swa_period=6,
        local_rope_base=10000.0,
        wide_scale_layers=62,
    ),
    "gpt2": Family(norm="layer", ffn="gelu", positions="learned", qkv_bias=True, fused_qkv=True, biases=True),
}
