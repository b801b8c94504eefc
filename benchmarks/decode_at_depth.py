"""Decode speed after a deep cache, without the prompt that would fill it: one process, one cache type.

    python benchmarks/decode_at_depth.py MODEL.gguf --type q8_0 --depth 16000 [--tree /path/to/other/checkout]

The cache is filled directly with random rows of its type (attention's work does not depend on the values), so
16,000 positions take seconds instead of minutes of prefill; then greedy tokens are decoded and timed. Run it in
alternating processes (f16 and q8_0, this tree and another) to compare: a shared machine's speed drifts.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a .gguf file")
    ap.add_argument("--type", default="f16", help="the cache type of keys and values: f16 or q8_0")
    ap.add_argument("--depth", type=int, default=16000, help="cached positions before decoding")
    ap.add_argument("-n", "--n-gen", type=int, default=32, help="greedy tokens decoded and timed")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose engine runs (default: this one)")
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree))

    import numpy as np

    from engine import cache_types
    from engine.loader import load_model

    model = load_model(
        args.model, n_ctx=args.depth + args.n_gen + 8, threads=args.threads,
        cache_type_k=args.type, cache_type_v=args.type,
    )  # fmt: skip
    session = model.session()
    rng = np.random.default_rng(0)
    cache = session.cache
    for layer in (*cache.k, *cache.v):  # (n_kv, rows, width): each row one position of one kv head
        n_kv, _, width = layer.shape
        hd = width if args.type == "f16" else width // cache_types.Q8_BYTES * cache_types.Q8_BLOCK
        rows = rng.standard_normal((n_kv, args.depth, hd)).astype(np.float32)
        layer[:, : args.depth] = cache_types.to_cache(np, rows, args.type).view(layer.dtype)
    cache.reserve(args.depth)
    session.tokens = [1] * args.depth
    logits = session.eval([1])
    start = time.perf_counter()
    for _ in range(args.n_gen):
        logits = session.eval([int(np.argmax(logits))])
    seconds = time.perf_counter() - start
    print(json.dumps({
        "tree": str(args.tree), "type": args.type, "depth": args.depth, "decode_tok_s": round(args.n_gen / seconds, 2),
        "cache_mb": round(cache.nbytes / 1e6, 1),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
