"""How a short pass (a speculative check: 2 to 17 tokens) should order its work, on this CPU.

    .venv/bin/python benchmarks/short_passes.py [-m qwen2.5-coder-1.5b-instruct] [--rounds 2] [--repeats 9]

Times every FFN matrix of the model (gate, up, down of every layer: more bytes than the L3 cache holds, as in
decoding) for passes of t tokens, three ways, each result bit for bit the one-token kernel's:
- `tiles`: the engine's packed.matmul: TILE tokens at a time from the first row (the first tile streams the
  weights from memory while it computes, the rest find them in cache), the last few one by one; under TILE
  tokens, padded to one tile.
- `lead`: one token through the one-token kernel first (it streams the weights), then tiles from cache (the
  engine's order before 2026-12-05, when it measured the faster on a Zen 5 with older prefetching).
- `padded`: every pass padded to whole tiles.
One token (`matvec`) is the memory-bound reference. Fastest of --repeats, over --rounds interleaved rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from compare_llama_cpp import cpu_description  # noqa: E402
from numba import njit, prange  # noqa: E402

from chatapp.catalog import resolve_model  # noqa: E402
from engine import load_model  # noqa: E402
from engine.kernels import packed  # noqa: E402
from engine.kernels.packed import ROWS, TILE, double_pairs, group_simd, group_simd_tile, quantize_into  # noqa: E402

TOKENS = (2, 3, 4, 5, 6, 8, 12, 16, 17)


@njit(parallel=True, nogil=True)
def lead_matmul(q, s, fmt, xs, out, xq, dx, xsum, xq2):
    """packed.matmul's order before: a lead token through the one-token kernel, then tiles, then the rest."""
    t = xs.shape[0]
    for i in prange(t):
        quantize_into(xs[i], xq[i], dx[i], xsum[i])
        if xq2.shape[0] > 0:
            double_pairs(xq[i], xq2[i])
    d = out.shape[1]
    for g in prange(q.shape[0]):
        rows = min(ROWS, d - g * ROWS)
        acc = np.empty((TILE, ROWS), dtype=np.float32)
        i = 0
        while i < t:
            if t - i >= TILE and i > 0:
                group_simd_tile(q, s, fmt, g, xq, xq2, dx, xsum, i, acc)
                done = TILE
            else:
                group_simd(q, s, fmt, g, xq[i], dx[i], xsum[i], acc[0])
                done = 1
            for k in range(done):
                for r in range(rows):
                    out[i + k, g * ROWS + r] = acc[k, r]
            i += done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    model = load_model(resolve_model(args.model), n_ctx=64)
    weights = [m for lw in model.weights.layers for m in (lw.w_gate, lw.w_up, lw.w_down)]
    mats = [(m.prepare().packed, m.cols) for m in weights]
    rng = np.random.default_rng(0)
    xs_by_cols = {c: rng.standard_normal((max(TOKENS) + TILE, c)).astype(np.float32) for _, c in mats}

    def run(kind: str, t: int) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for p, n in mats:
                rows = -(-t // TILE) * TILE if kind == "padded" else t
                xs = xs_by_cols[n][:rows]
                out = np.empty((rows, p.q.shape[0] * ROWS), dtype=np.float32)
                bufs = packed.row_buffers(rows, n, None, bool(packed.PAIRED[p.code]))
                if kind == "matvec":
                    packed.matvec(p.q, p.s, p.fmt, xs[0], out[0])
                elif kind == "lead":
                    lead_matmul(p.q, p.s, p.fmt, xs, out, *bufs)
                else:
                    packed.matmul(p.q, p.s, p.fmt, xs, out, *bufs, False)
            best = min(best, time.perf_counter() - t0)
        return best * 1000

    kinds = ("tiles", "lead", "padded")
    res: dict[tuple[int, str], float] = {}
    for _ in range(args.rounds):
        res[1, "matvec"] = min(res.get((1, "matvec"), float("inf")), run("matvec", 1))
        for t in TOKENS:
            for kind in kinds:
                res[t, kind] = min(res.get((t, kind), float("inf")), run(kind, t))
    total = sum(p.nbytes for p, _ in mats) / 1e6
    print(f"{model.name}: its {len(mats)} FFN matrices, {total:.0f} MB; {model.threads} threads")
    print(cpu_description())
    print(f"1 token (matvec): {res[1, 'matvec']:.1f} ms")
    for t in TOKENS:
        print(f"{t:2d} tokens: " + "  ".join(f"{k} {res[t, k]:6.1f}" for k in kinds) + " ms")


if __name__ == "__main__":
    main()
