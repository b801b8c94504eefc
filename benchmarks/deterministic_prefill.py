"""Prefill speed with and without row-count-invariant prompt passes (Model.deterministic), interleaved in one
process: each repeat times a fresh session's eval of the same prompt once each way, in alternating order.

    python benchmarks/deterministic_prefill.py MODEL.gguf [--tokens 256 1024] [--repeats 5]

Prints the median and every time per prompt length. The machine's other load moves single times a lot: compare
medians only, from one run. Then, as the part that differs, the attention of one 256-row pass alone for one layer
of the model (its head shapes, random queries over a filled cache) at several start positions, both ways,
interleaved, median of --attention-repeats: times 28 layers, against the prefill's time per pass, it gives the
cost with less noise than whole prefills.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from engine import kernels, load_model


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--attention-repeats", type=int, default=15)
    ap.add_argument("--starts", type=int, nargs="+", default=[0, 256, 768, 1792])
    args = ap.parse_args()
    model = load_model(args.model, n_ctx=max(args.tokens), threads=args.threads)
    print(f"{model.name}, {cpu_name()}, {model.threads} threads")
    ids = [(7 * i + 1000) % 20000 + 100 for i in range(max(args.tokens))]  # ordinary ids, no special tokens
    for mode in (False, True):  # compile and warm both paths
        model.deterministic = mode
        model.session().eval(ids[:64])
    for n in args.tokens:
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.repeats):
            for mode in ((False, True) if r % 2 == 0 else (True, False)):
                model.deterministic = mode
                session = model.session(n)
                t0 = time.perf_counter()
                session.eval(ids[:n])
                times[mode].append(time.perf_counter() - t0)
        base, det = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"{n} tokens: BLAS attention {n / base:.1f} tok/s (median of {args.repeats}), row-invariant "
            f"{n / det:.1f} tok/s: {100 * (det / base - 1):+.1f}% time"
        )
        for mode, label in ((False, "BLAS"), (True, "invariant")):
            print(f"  {label}: " + ", ".join(f"{t:.2f}" for t in times[mode]) + " s")
    attention_alone(model, args.starts, args.attention_repeats)


def attention_alone(model, starts: list[int], repeats: int, t: int = 256) -> None:
    """One layer's attention for a pass of t rows at each start, BLAS blocks against one-token rows."""
    cfg = model.cfg
    rng = np.random.default_rng(0)
    n_ctx = max(starts) + t
    kc = rng.standard_normal((cfg.n_kv_head, n_ctx, cfg.head_dim)).astype(np.float16)
    vc = rng.standard_normal((cfg.n_kv_head, n_ctx, cfg.head_dim)).astype(np.float16)
    q = rng.standard_normal((t, cfg.n_head, cfg.head_dim)).astype(np.float32)
    for rowwise in (False, True):  # compile
        kernels.causal_attention(q, kc, vc, 0, rowwise=rowwise)
    for start in starts:
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(repeats):
            for rowwise in (False, True) if r % 2 == 0 else (True, False):
                t0 = time.perf_counter()
                kernels.causal_attention(q, kc, vc, start, rowwise=rowwise)
                times[rowwise].append(time.perf_counter() - t0)
        base, rows = (1000 * statistics.median(times[m]) for m in (False, True))
        print(
            f"attention, {t} rows from position {start}, one layer: BLAS {base:.1f} ms, one-token rows {rows:.1f} ms"
            f" (x{cfg.n_layer} layers: +{cfg.n_layer * (rows - base):.0f} ms a pass)"
        )


if __name__ == "__main__":
    main()
