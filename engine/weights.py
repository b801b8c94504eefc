"""Bind the tensors of a GGUF file to the forward pass, checking each against the architecture first."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import overload

import gguf
import numpy as np

from .config import ModelConfig
from .errors import ModelFileError, UnsupportedModelError
from .gguf_file import GGUFFile, TensorEntry
from .kernels import SUPPORTED_TYPES, WeightMatrix, dequantize
from .kernels.pages import FileRows, file_copy
from .moe import RouterFfn


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray  # (d,)
    attn_norm_b: np.ndarray | None  # (d,) LayerNorm only
    wqkv: tuple[WeightMatrix, WeightMatrix, WeightMatrix]  # wq, wk, wv; a file's fused attn_qkv is split in three
    bqkv: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # biases matching wqkv
    q_norm: np.ndarray | None  # (head_dim,) per-head RMSNorm of q and k before RoPE (qk_norm families)
    k_norm: np.ndarray | None
    post_attn_norm: np.ndarray | None  # (d,) norms of each branch's output before the residual (post_norms)
    post_ffn_norm: np.ndarray | None
    wo: WeightMatrix  # (d, n_head·head_dim)
    bo: np.ndarray | None
    ffn_norm: np.ndarray
    ffn_norm_b: np.ndarray | None
    w_gate: WeightMatrix | None  # (d_ff, d) gated FFNs only
    w_up: WeightMatrix | None  # (d_ff, d); None in a mixture-of-experts layer
    b_up: np.ndarray | None
    w_down: WeightMatrix | None  # (d, d_ff); None in a mixture-of-experts layer
    b_down: np.ndarray | None
    moe: RouterFfn | None = None  # the router and experts of a mixture-of-experts layer


@dataclass(frozen=True)
class Weights:
    token_embd: WeightMatrix  # (n_vocab, d)
    token_rows: FileRows | None  # token_embd's rows read from the file, where the platform can
    position_embd: np.ndarray | None  # (n_ctx_train, d) for learned positions
    output_norm: np.ndarray
    output_norm_b: np.ndarray | None
    output: WeightMatrix  # (n_vocab, d); token_embd itself when tied
    rope_freqs: np.ndarray | None  # (rope_dim/2,) frequency divisors (Llama 3)
    layers: tuple[LayerWeights, ...]

    def products(self) -> list[WeightMatrix]:
        """The matrices a token multiplies by: every layer's and the output head (of the embedding, a token
        reads a single row). Of a mixture-of-experts layer, the router and any shared expert: its experts are
        prepared when chosen."""
        mats: list[WeightMatrix | None] = [self.output]
        for lw in self.layers:
            mats += [*lw.wqkv, lw.wo, lw.w_gate, lw.w_up, lw.w_down, *(lw.moe.matrices() if lw.moe else ())]
        return [m for m in mats if m is not None]

    def decode_bytes(self) -> int:
        """The weight bytes one decoded token reads, packed where they are; of a mixture-of-experts layer, its
        router and n_used experts."""
        return sum(m.nbytes for m in self.products()) + sum(lw.moe.expert_bytes() for lw in self.layers if lw.moe)


def _fmt(shape: tuple[int, ...]) -> str:
    return "×".join(str(n) for n in shape)


# Tensors of features we do not run: a file holding one is refused by name rather than run without it.
_UNSUPPORTED_TENSORS = {
    "_exps.": "mixture-of-experts tensors",
    "ffn_gate_inp.": "mixture-of-experts tensors",
    "_shexp.": "shared-expert tensors",
    "rope_factors_long.": "LongRoPE rope scaling",
    "rope_factors_short.": "LongRoPE rope scaling",
}


def check_tensors(file: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor the architecture needs is present, with the right shape and a type we can run."""
    for name in file.tensors:
        for part, feature in _UNSUPPORTED_TENSORS.items():
            runs = cfg.d_ff_shexp > 0 if part == "_shexp." else cfg.spec.moe and feature.startswith("mixture")
            if part in name and not runs:
                raise UnsupportedModelError(f"tensor {name}: {feature} are not supported")
    for name, (shape, required) in cfg.expected_tensors().items():
        t = file.tensors.get(name)
        if t is None:
            if required:
                raise ModelFileError(f"tensor {name}: missing (the {cfg.arch} architecture needs it)")
            continue
        if t.shape != shape:
            raise ModelFileError(f"tensor {name}: expected {_fmt(shape)}, file has {_fmt(t.shape)}")
        if t.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(f"tensor {name}: type {t.ggml_type.name} is not supported")
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.ggml_type]
        if shape[0] % block:
            raise ModelFileError(f"tensor {name}: row length {shape[0]} is not a multiple of {block}")
        n_bytes = int(np.prod(shape)) // block * block_bytes
        if t.data.nbytes != n_bytes:
            raise ModelFileError(f"tensor {name}: data is {t.data.nbytes} bytes, expected {n_bytes} (truncated file?)")


def _matrix(t: TensorEntry) -> WeightMatrix:
    cols, rows = t.shape
    return WeightMatrix.from_raw(t.name, t.ggml_type, rows, cols, t.data)


def _split_rows(w: WeightMatrix, sizes: tuple[int, int, int]) -> tuple[WeightMatrix, WeightMatrix, WeightMatrix]:
    """W's row blocks of the given sizes, as views of its data: a fused attn_qkv as q, k, v."""
    out, r0 = [], 0
    for part, rows in zip("qkv", sizes, strict=True):
        out.append(WeightMatrix(f"{w.name}[{part}]", w.ggml_type, rows, w.cols, w.data[r0 : r0 + rows]))
        r0 += rows
    q, k, v = out
    return q, k, v


@overload
def _vector(t: TensorEntry) -> np.ndarray: ...
@overload
def _vector(t: TensorEntry | None) -> np.ndarray | None: ...
def _vector(t: TensorEntry | None) -> np.ndarray | None:
    """Small 1-D tensors (norms, biases) as float32, read from the file (`file_copy`)."""
    if t is None:
        return None
    return dequantize(WeightMatrix.from_raw(t.name, t.ggml_type, 1, t.shape[0], file_copy(t.data)))[0]


def bind_weights(file: GGUFFile, cfg: ModelConfig) -> Weights:
    """Views into the mapped file; only norms and biases are copied (as float32)."""
    check_tensors(file, cfg)
    ts = file.tensors
    sizes = (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim)
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        if cfg.spec.fused_qkv:  # rows [q; k; v]
            wqkv = _split_rows(_matrix(ts[p + "attn_qkv.weight"]), sizes)
            bqkv = None
            if cfg.spec.qkv_bias:
                b = _vector(ts[p + "attn_qkv.bias"])
                bqkv = (b[: sizes[0]], b[sizes[0] : sizes[0] + sizes[1]], b[sizes[0] + sizes[1] :])
        else:
            wqkv = (
                _matrix(ts[p + "attn_q.weight"]),
                _matrix(ts[p + "attn_k.weight"]),
                _matrix(ts[p + "attn_v.weight"]),
            )
            if cfg.spec.qkv_bias:
                bqkv = (_vector(ts[p + "attn_q.bias"]), _vector(ts[p + "attn_k.bias"]), _vector(ts[p + "attn_v.bias"]))
            else:
                bqkv = None
        layers.append(
            LayerWeights(
                attn_norm=_vector(ts[p + "attn_norm.weight"]),
                attn_norm_b=_vector(ts.get(p + "attn_norm.bias")),
                wqkv=wqkv,
                bqkv=bqkv,
                q_norm=_vector(ts.get(p + "attn_q_norm.weight")),
                k_norm=_vector(ts.get(p + "attn_k_norm.weight")),
                post_attn_norm=_vector(ts.get(p + "post_attention_norm.weight")),
                post_ffn_norm=_vector(ts.get(p + "post_ffw_norm.weight")),
                wo=_matrix(ts[p + "attn_output.weight"]),
                bo=_vector(ts.get(p + "attn_output.bias")),
                ffn_norm=_vector(ts[p + "ffn_norm.weight"]),
                ffn_norm_b=_vector(ts.get(p + "ffn_norm.bias")),
                w_gate=_matrix(ts[p + "ffn_gate.weight"]) if cfg.spec.ffn != "gelu" and not cfg.spec.moe else None,
                w_up=None if cfg.spec.moe else _matrix(ts[p + "ffn_up.weight"]),
                b_up=_vector(ts.get(p + "ffn_up.bias")),
                w_down=None if cfg.spec.moe else _matrix(ts[p + "ffn_down.weight"]),
                b_down=_vector(ts.get(p + "ffn_down.bias")),
                moe=RouterFfn.bind(file, cfg, i) if cfg.spec.moe else None,
            )
        )
    token_embd = _matrix(ts["token_embd.weight"])
    pos = ts.get("position_embd.weight")
    return Weights(
        token_embd=token_embd,
        token_rows=FileRows.of(token_embd.data),
        position_embd=dequantize(_matrix(replace(pos, data=file_copy(pos.data)))) if pos is not None else None,
        output_norm=_vector(ts["output_norm.weight"]),
        output_norm_b=_vector(ts.get("output_norm.bias")),
        output=_matrix(ts["output.weight"]) if "output.weight" in ts else token_embd,
        rope_freqs=_vector(ts.get("rope_freqs.weight")),
        layers=tuple(layers),
    )
