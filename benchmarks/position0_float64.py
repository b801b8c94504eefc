"""Which side is right at position 0: a float64 evaluation of a llama/qwen2 GGUF's first token against ours
and llama.cpp's (a golden file's teacher-forced log-probs).

    python benchmarks/position0_float64.py -m MODEL.gguf --golden tests/golden/NAME.json

At position 0 attention over one key returns its value, so the first token's logits need no cache: every
weight is dequantized by gguf-py (not our kernels), one matrix at a time, and applied in float64. Prints, for
llama.cpp's top-5 next tokens of each golden text's position 0, the log-probs of float64, ours (default int8
activations and float products) and llama.cpp, and the largest activation in the residual stream per layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max()
    return x - np.log(np.exp(x).sum())


def float64_first_token(path: Path, token: int) -> tuple[np.ndarray, list[float]]:
    """Logits (n_vocab,) of `token` alone at position 0, in float64; and max |x| after each layer."""
    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta[f"{arch}.attention.head_count_kv"])
    eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])

    def w(name: str) -> np.ndarray:
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(tuple(reversed(t.shape)))

    def rms(x: np.ndarray, weight: str) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x) + eps) * w(weight)

    embd = tensors["token_embd.weight"]
    x = gguf.quants.dequantize(embd.data[token : token + 1], embd.tensor_type).astype(np.float64).reshape(-1)  # (d,)
    peaks = []
    for i in range(int(meta[f"{arch}.block_count"])):
        p = f"blk.{i}."
        h = rms(x, p + "attn_norm.weight")
        v = w(p + "attn_v.weight") @ h
        if p + "attn_v.bias" in tensors:
            v = v + w(p + "attn_v.bias")
        hd = v.shape[0] // n_kv
        att = np.repeat(v.reshape(n_kv, hd), n_head // n_kv, axis=0).reshape(-1)  # softmax over one key: its value
        x = x + w(p + "attn_output.weight") @ att
        h = rms(x, p + "ffn_norm.weight")
        g, u = w(p + "ffn_gate.weight") @ h, w(p + "ffn_up.weight") @ h
        x = x + w(p + "ffn_down.weight") @ (g / (1 + np.exp(-g)) * u)
        peaks.append(float(np.abs(x).max()))
    h = rms(x, "output_norm.weight")
    out = tensors.get("output.weight") or tensors["token_embd.weight"]
    rows = []
    for r0 in range(0, out.shape[1], 16384):  # the head a slice of rows at a time
        block = gguf.quants.dequantize(out.data[r0 : r0 + 16384], out.tensor_type).astype(np.float64)
        rows.append(block.reshape(-1, out.shape[0]) @ h)
    return np.concatenate(rows), peaks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--golden", type=Path, required=True)
    ap.add_argument("--json", type=Path, help="also write the float64 log-probs of llama.cpp's top-5 here")
    args = ap.parse_args()
    from engine import load_model
    from engine.kernels import float_products

    golden = json.loads(args.golden.read_text())
    model = load_model(args.model, n_ctx=64)
    record = {"model_sha256": golden["model_sha256"], "source": "benchmarks/position0_float64.py", "texts": []}
    for item in golden["teacher"]:
        token = item["ids"][0]
        exact, peaks = float64_first_token(args.model, token)
        ours = model.logits([token])[0]
        with float_products():
            ours_float = model.logits([token])[0]
        lp = {name: log_softmax(v) for name, v in (("float64", exact), ("ours", ours), ("ours float", ours_float))}
        print(f"token {token}: residual max |x| per layer {[round(p) for p in peaks]}")
        print(f"{'id':>8} {'llama.cpp':>10} " + " ".join(f"{k:>11}" for k in lp))
        for tid, ref in zip(item["top5_ids"][0], item["top5_logprobs"][0], strict=True):
            print(f"{tid:>8} {ref:>10.3f} " + " ".join(f"{v[tid]:>11.3f}" for v in lp.values()))
        print("top-1:", {k: int(v.argmax()) for k, v in lp.items()}, "llama.cpp", item["top5_ids"][0][0])
        ids = [int(i) for i in np.argsort(exact)[::-1][:5]]
        ref_ids = item["top5_ids"][0]
        record["texts"].append(
            {
                "token": token,
                "float64_top5_ids": ids,
                "float64_top5_logprobs": [float(lp["float64"][i]) for i in ids],
                "llama_cpp_top5_ids": ref_ids,
                "float64_logprobs_of_llama_cpp_top5": [float(lp["float64"][i]) for i in ref_ids],
            }
        )
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
