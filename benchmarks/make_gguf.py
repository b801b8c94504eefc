"""Full-size random-weight GGUF files of a chosen llama or Qwen3-MoE shape and type mix, for speed comparisons.

    python benchmarks/make_gguf.py --preset llama-8b -o /tmp/llama-8b-q4_k_m.gguf
    python benchmarks/make_gguf.py --preset llama-3b --mix q4_k_m -o /tmp/llama-3b-q4_k_m.gguf
    python benchmarks/make_gguf.py --preset qwen3moe-30b-a3b -o /tmp/qwen3moe-30b-a3b-12l.gguf

Speed at large sizes needs large files, and downloading a 4.5 GB model for a benchmark is slow and not always
allowed. These files have a real model's shapes and quant types, so both engines do exactly the work they would
on the real model, but their weights are random: the text they write is noise, their speed is not.

- Shapes: `llama-3b` is Llama 3.2 3B's (d 3072, FFN 8192, 28 layers, 24 query / 8 KV heads), `llama-8b`
  Llama 3.1 8B's (d 4096, FFN 14336, 32 layers, 32 / 8 heads); `tiny` is for tests.
  `qwen3moe-30b-a3b` is Qwen3-30B-A3B's layer (d 2048; 32 query / 4 KV heads of 128, q/k norms; a router over
  128 experts, 8 used, each a SwiGLU FFN 768 wide) cut to 12 of its 48 layers (4.7 GB); `tiny-moe` is for tests.
- Mixes: `q4_k_m` as llama.cpp's Q4_K_M (Q4_K matrices; Q6_K on the output head and on attn_v and ffn_down in
  the layers llama.cpp's `use_more_bits` picks, half of them); `q4_k` (Q4_K everywhere but a Q6_K head);
  `q6_k` (Q6_K everywhere). Norms are F32 ones. The experts' stacked matrices take their dense names' types
  (ffn_down_exps as ffn_down, as llama.cpp's quantizer does); the router (ffn_gate_inp) is F32, random.
- Vocabulary: borrowed from a real GGUF (SmolLM2-135M-Instruct by default: its tokenizer.* keys and chat
  template), n_vocab set from it; the embedding and head have that many rows.

The blocks' bytes are written directly (layouts from llama.cpp's ggml-common.h), from a seeded SFC64 stream,
tensor by tensor in chunks, so a 4.5 GB file takes seconds and little memory, and the same seed writes the same
file. Quant codes are the random bits as drawn; the per-block scales are set so every weight is finite and of
the size 1/sqrt(n_in), and every float16 scale is a normal number:
- block_q4_K (144 bytes, 256 weights): d, dmin (float16); 12 bytes of eight 6-bit scales and eight 6-bit mins;
  128 bytes of 4-bit codes. w = d * sc * q - dmin * m, with sc in 8..15, m = round(15 sc / 16), dmin = 8 d,
  so each 32-weight group is centred on zero.
- block_q6_K (210 bytes, 256 weights): 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales,
  d (float16). w = d * sc * (q - 32), with sc in 2..5.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256  # weights per K-quant block
SMOLLM2 = Path.home() / ".cache" / "chatapp" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNK_BYTES = 32 << 20  # bytes of one tensor generated and written at a time


@dataclass(frozen=True)
class Shape:
    d: int  # embedding width
    d_ff: int  # FFN hidden width
    n_layer: int
    n_head: int  # query heads
    n_kv: int  # key/value heads
    rope_base: float = 500000.0
    n_ctx_train: int = 131072  # the context length the file declares
    arch: str = "llama"  # llama, or qwen3moe: q/k norms, the FFN a router over experts
    head_dim_kv: int = 0  # head width where it is not d / n_head (Qwen3's 128 with d 2048 and 32 heads)
    n_expert: int = 0  # experts per layer; 0: a dense FFN d_ff wide
    n_expert_used: int = 0  # experts each token runs (the router's top-k)
    d_ff_exp: int = 0  # one expert's hidden width

    @property
    def head_dim(self) -> int:
        return self.head_dim_kv or self.d // self.n_head


PRESETS = {
    "llama-3b": Shape(d=3072, d_ff=8192, n_layer=28, n_head=24, n_kv=8),  # Llama 3.2 3B
    "llama-8b": Shape(d=4096, d_ff=14336, n_layer=32, n_head=32, n_kv=8),  # Llama 3.1 8B
    "tiny": Shape(d=256, d_ff=512, n_layer=2, n_head=4, n_kv=2, n_ctx_train=4096),  # for tests: seconds
    # Qwen3-30B-A3B's layer (d 2048, 128 experts of width 768, 8 used, 32 / 4 heads of 128) in 12 of its 48 layers
    "qwen3moe-30b-a3b": Shape(
        d=2048,
        d_ff=6144,
        n_layer=12,
        n_head=32,
        n_kv=4,
        rope_base=1e6,
        n_ctx_train=40960,
        arch="qwen3moe",
        head_dim_kv=128,
        n_expert=128,
        n_expert_used=8,
        d_ff_exp=768,
    ),
    # the same kinds of tensors, small: for tests
    "tiny-moe": Shape(
        d=256,
        d_ff=512,
        n_layer=2,
        n_head=4,
        n_kv=2,
        n_ctx_train=4096,
        rope_base=1e6,
        arch="qwen3moe",
        head_dim_kv=128,
        n_expert=16,
        n_expert_used=4,
        d_ff_exp=256,
    ),
}
MIXES = ("q4_k_m", "q4_k", "q6_k")
FILE_TYPE = {"q4_k_m": 15, "q4_k": 14, "q6_k": 18}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* (Q4_K_S for q4_k)


def use_more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M (half of them)."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def tensor_type(mix: str, name: str, layer: int, n_layer: int) -> T:
    """The ggml type of matrix `name` (in layer `layer`, -1 outside the layers) in mix `mix`."""
    if mix == "q6_k" or name == "output.weight":
        return T.Q6_K
    if mix == "q4_k_m" and name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) \
            and use_more_bits(layer, n_layer):  # fmt: skip
        return T.Q6_K
    if name.endswith("ffn_gate_inp.weight"):  # the router: llama.cpp's quantizer leaves it F32
        return T.F32
    return T.Q4_K


def matrices(shape: Shape, n_vocab: int) -> list[tuple[str, int, int, int, int]]:
    """(name, layer, n_out, n_in, n_expert) of every matrix, in llama.cpp's order; layer -1 outside the blocks;
    n_expert 0 but for the experts' stacked matrices."""
    q, kv, ne = shape.n_head * shape.head_dim, shape.n_kv * shape.head_dim, shape.n_expert
    if ne:  # the router, then the experts' gate, up and down
        fe, d = shape.d_ff_exp, shape.d
        ffn = [("ffn_gate_inp", ne, d, 0), ("ffn_gate_exps", fe, d, ne), ("ffn_up_exps", fe, d, ne),
               ("ffn_down_exps", d, fe, ne)]  # fmt: skip
    else:
        ffn = [("ffn_gate", shape.d_ff, shape.d, 0), ("ffn_up", shape.d_ff, shape.d, 0),
               ("ffn_down", shape.d, shape.d_ff, 0)]  # fmt: skip
    out = [("token_embd.weight", -1, n_vocab, shape.d, 0)]
    for i in range(shape.n_layer):
        attn = [("attn_q", q, shape.d, 0), ("attn_k", kv, shape.d, 0), ("attn_v", kv, shape.d, 0),
                ("attn_output", shape.d, q, 0)]  # fmt: skip
        out += [(f"blk.{i}.{name}.weight", i, n_out, n_in, n_exp) for name, n_out, n_in, n_exp in attn + ffn]
    out.append(("output.weight", -1, n_vocab, shape.d, 0))
    return out


def plan(shape: Shape, mix: str, n_vocab: int) -> list[tuple[str, T, tuple[int, ...]]]:
    """(name, ggml type, numpy byte shape) of every tensor, in file order; norms are F32 ones."""
    out: list[tuple[str, T, tuple[int, ...]]] = []
    for mat, layer, n_out, n_in, n_exp in matrices(shape, n_vocab):
        if mat == "output.weight":
            out.append(("output_norm.weight", T.F32, (shape.d,)))
        ggml_type = tensor_type(mix, mat, layer, shape.n_layer)
        if ggml_type == T.F32:  # the router: (n_expert, d) float32
            out.append((mat, T.F32, (n_out, n_in)))
            continue
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        out.append((mat, ggml_type, (n_exp, n_out, n_in // block_size * type_size)[0 if n_exp else 1 :]))
        if mat.endswith(("ffn_down.weight", "ffn_down_exps.weight")):
            out += [(f"blk.{layer}.attn_norm.weight", T.F32, (shape.d,)),
                    (f"blk.{layer}.ffn_norm.weight", T.F32, (shape.d,))]  # fmt: skip
            if shape.arch == "qwen3moe":  # RMS norms of each head's q and k
                out += [(f"blk.{layer}.attn_q_norm.weight", T.F32, (shape.head_dim,)),
                        (f"blk.{layer}.attn_k_norm.weight", T.F32, (shape.head_dim,))]  # fmt: skip
    return out


def _f16(x: np.ndarray) -> np.ndarray:
    """float16 bytes of x: (n,) -> (n, 2) uint8."""
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def q4_k_blocks(bits: np.ndarray, sigma: float) -> np.ndarray:
    """Random block_q4_K bytes whose weights have standard deviation ~sigma: bits (n, 144) uint8, set in place."""
    n = bits.shape[0]
    sc = 8 + (bits[:, 4:12] & 7)  # (n, 8) 6-bit scales, 8..15, from the random bits already there
    m = (15 * sc.astype(np.uint16) + 8) // 16  # (n, 8) mins: dmin * m ~ d * sc * 7.5, the codes' mean
    # One group's weights: d * sc * (q - 7.5), q uniform 0..15 (sd 4.61), sc ~ 11.5; d jitters +-25 % by block.
    d = sigma / (11.5 * 4.61) * (0.75 + bits[:, 0] / 510.0)  # (n,)
    scales = np.empty((n, 12), np.uint8)  # ggml's packing, the inverse of get_scale_min_k4
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    bits[:, 0:2] = _f16(d)
    bits[:, 2:4] = _f16(8 * d)  # dmin
    bits[:, 4:16] = scales
    return bits  # codes qs[128] at 16: the random bits as drawn


def q6_k_blocks(bits: np.ndarray, sigma: float) -> np.ndarray:
    """Random block_q6_K bytes whose weights have standard deviation ~sigma: bits (n, 210) uint8, set in place."""
    sc = 2 + (bits[:, 192:208] & 3)  # (n, 16) int8 scales 2..5
    # w = d * sc * (q - 32), q uniform 0..63 (sd 18.5), sc ~ 3.5; d jitters +-25 % by block.
    d = sigma / (3.5 * 18.5) * (0.75 + bits[:, 208] / 510.0)  # (n,)
    bits[:, 192:208] = sc
    bits[:, 208:210] = _f16(d)
    return bits  # ql[128] at 0 and qh[64] at 128: the random bits as drawn


ENCODERS = {T.Q4_K: q4_k_blocks, T.Q6_K: q6_k_blocks}


def tensor_chunks(
    ggml_type: T, n_out: int, n_in: int, rng: np.random.Generator, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[np.ndarray]:
    """The tensor's bytes, a few whole rows at a time: (rows, n_in / 256 * block bytes) uint8 arrays."""
    if n_in % QK_K:
        raise ValueError(f"{ggml_type.name} needs rows that are a multiple of {QK_K} wide, not {n_in}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    row_bytes = n_in // block_size * type_size
    sigma = 1.0 / np.sqrt(n_in)  # keeps every layer's output near unit size on unit-RMS inputs
    step = max(1, chunk_bytes // row_bytes)
    for r0 in range(0, n_out, step):
        rows = min(step, n_out - r0)
        n_bytes = rows * row_bytes
        words = rng.bit_generator.random_raw(-(-n_bytes // 8))  # (ceil(n_bytes / 8),) uint64
        bits = words.view(np.uint8)[:n_bytes].reshape(-1, type_size)  # (n_blocks, type_size)
        yield ENCODERS[ggml_type](bits, sigma).reshape(rows, row_bytes)


def vocabulary(source: Path) -> tuple[list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]], int]:
    """The tokenizer.* keys of `source` as (key, value, type, array item type), and its number of tokens."""
    if not source.is_file():
        raise FileNotFoundError(f"vocabulary source {source} does not exist (pass --vocab-from FILE.gguf)")
    reader = gguf.GGUFReader(source)
    keys = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            keys.append((key, field.contents(), field.types[0], sub))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens to borrow")
    return keys, len(tokens.data)


def write_model(
    path: Path, shape: Shape, mix: str = "q4_k_m", seed: int = 0, vocab_from: Path = SMOLLM2, name: str = "random"
) -> int:
    """Write the random-weight GGUF of `shape` (its architecture) to `path`; returns its size in bytes."""
    if mix not in MIXES:
        raise ValueError(f"unknown type mix {mix!r}: one of {', '.join(MIXES)}")
    vocab_keys, n_vocab = vocabulary(vocab_from)
    w = gguf.GGUFWriter(path, shape.arch)
    w.add_name(f"{name} (random weights)")
    w.add_block_count(shape.n_layer)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.d)
    w.add_feed_forward_length(shape.d_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_kv)
    w.add_rope_freq_base(shape.rope_base)
    w.add_rope_dimension_count(shape.head_dim)
    if shape.n_expert:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        w.add_expert_feed_forward_length(shape.d_ff_exp)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(FILE_TYPE[mix])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in vocab_keys:
        w.add_key_value(key, value, vtype, sub_type=sub)

    tensors = plan(shape, mix, n_vocab)
    for tname, ggml_type, byte_shape in tensors:
        n_bytes = int(np.prod(byte_shape)) * (4 if ggml_type == T.F32 else 1)
        if ggml_type == T.F32:
            w.add_tensor_info(tname, byte_shape, np.dtype(np.float32), n_bytes)
        else:
            w.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), n_bytes, raw_dtype=ggml_type)

    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]  # tensor data, streamed chunk by chunk, padded as GGUFWriter.write_tensor_data pads
    seeds = np.random.SeedSequence(seed).spawn(len(tensors))  # one stream per tensor
    for (_, ggml_type, byte_shape), ss in zip(tensors, seeds, strict=True):
        w.write_padding(fout, fout.tell())
        rng = np.random.Generator(np.random.SFC64(ss))
        if ggml_type == T.F32 and len(byte_shape) == 1:  # a norm
            np.ones(byte_shape, np.float32).tofile(fout)
        elif ggml_type == T.F32:  # the router (n_expert, d): logits of about unit spread on unit-RMS inputs
            (rng.standard_normal(byte_shape, np.float32) / np.float32(np.sqrt(byte_shape[1]))).tofile(fout)
        else:
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            rows, row_bytes = int(np.prod(byte_shape[:-1])), byte_shape[-1]  # experts: their matrices' rows stacked
            for chunk in tensor_chunks(ggml_type, rows, row_bytes // type_size * block_size, rng):
                chunk.tofile(fout)
        w.write_padding(fout, int(np.prod(byte_shape)) * (4 if ggml_type == T.F32 else 1))
    w.close()
    return path.stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", type=Path, required=True, help="the .gguf file to write")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-8b")
    ap.add_argument("--mix", choices=MIXES, default="q4_k_m")
    ap.add_argument("--layers", type=int, help="override the preset's layer count (a smaller file, same layers)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-from", type=Path, default=SMOLLM2, help="the GGUF whose tokenizer to borrow")
    args = ap.parse_args()
    shape = PRESETS[args.preset]
    if args.layers is not None:
        if args.layers < 1:
            ap.error("--layers must be at least 1")
        shape = Shape(**{**shape.__dict__, "n_layer": args.layers})
    t0 = time.perf_counter()
    try:
        size = write_model(args.out, shape, args.mix, args.seed, args.vocab_from, name=f"{args.preset}-{args.mix}")
    except (OSError, ValueError) as e:
        print(f"make_gguf: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
