"""Decode kernels of this CPU's kernel set ("new") against another set ("old", --against: AVX2 by default, the
kernels before the AVX-512 ones; `portable` for the plain vector IR): GB/s per format and shape.

    .venv/bin/python benchmarks/bench_kernels.py [--threads 2] [--rounds 5] [--cold] [--formats Q4_1,Q8_0]
    .venv/bin/python benchmarks/bench_kernels.py --model ~/.cache/chatapp/models/SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python benchmarks/bench_kernels.py --against portable --no-old   # the host set alone
    .venv/bin/python benchmarks/bench_kernels.py --prefill --formats none   # prompt products only

Both sets are compiled in this one process (simd.build_kernels; the old set's weights packed in its own
layout) and must be runnable here. GB/s counts the weight's bytes in the file encoding. The variants are timed
in alternating rounds, and the best round is reported (the machine may be shared: the best round is the least
disturbed one); "cpu" is bytes per CPU-second (process_time), which other processes disturb less than wall time
but which also counts OpenMP threads spinning. --cold rotates through copies of the weight that together exceed
the L3 cache, as decoding does; without it one weight is reused and mostly sits in cache.
--model times every matrix of a real model in decode order (one token's products) and projects tokens/s, beside
"read": a plain read of the same packed bytes with the same split across threads (`plain_read`), the ceiling
the products could stream at.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp tbb workqueue")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from engine.formats.dispatch import tag  # noqa: E402
from engine.kernels import (  # noqa: E402
    BLOCK_CODES,
    PARALLEL_MIN_BYTES,
    WeightMatrix,
    matmul,
    matvec,
    matvec_many,
    packed,
    simd,
)

# (rows, cols) of the decode products in the two real models
SHAPES = {
    T.Q4_0: [(576, 576), (4864, 896)],
    T.Q4_1: [(576, 576), (1536, 576), (576, 1536), (4864, 896)],
    T.Q5_0: [(896, 896), (4864, 896), (128, 896)],
    T.Q8_0: [(128, 896), (4864, 896), (49152, 576)],
    T.Q4_K: [(896, 4864)],
    T.Q6_K: [(896, 4864)],
    T.Q5_1: [(576, 576)],
    T.Q5_K: [(896, 4864)],
}
HALF_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82]}
HALF_FIELDS |= {T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
L3_BYTES = 32 << 20


def random_weight(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        raw[:, off : off + 2] = rng.uniform(-0.1, 0.1, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


class OtherKernels:
    """The decode products of another kernel set, compiled in this process: `pack` a file weight into its layout,
    `matvec` it as engine.kernels.matvec does (serial below PARALLEL_MIN_BYTES)."""

    def __init__(self, isa: str):
        self.kernels = simd.kernel_set(isa, simd.KERNELS.f16c)
        ns = types.ModuleType(f"simd_{isa}")  # a module, as group_flat's `simd.` lookups need
        ns.BLOCKS, ns.BLOCKS_TILE = simd.build_kernels(self.kernels)
        # the drivers' chain down to the block kernels, each link compiled again over the next
        flat = numba.njit(nogil=True)(_rebound(packed.group_flat, simd=ns))
        into = numba.njit(inline="always", nogil=True)(_rebound(packed.group_into, group_flat=flat))
        groups = numba.njit(nogil=True)(_rebound(packed.groups_into, group_into=into))
        self._parallel = numba.njit(parallel=True, nogil=True)(_rebound(packed.matvec_quantized, groups_into=groups))
        self._serial = numba.njit(nogil=True)(_rebound(packed.matvec_quantized_serial, groups_into=groups))

    def pack(self, code: int, rows: int, cols: int, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        qb, copies, halves = packed.layout_tables(code)
        block, block_bytes = GGML_QUANT_SIZES[T(code)]
        lanes, width = self.kernels.layout(code)
        g = -(-rows // packed.ROWS)
        q = np.zeros((g, cols // block, packed.ROWS // lanes, qb // width, lanes, width), dtype=np.uint8)
        s = np.zeros((g, cols // block, len(halves), packed.ROWS), dtype=np.uint16)
        packed.pack(np.ascontiguousarray(raw), tag(code), block_bytes, copies, halves, q, s)
        return q, s

    def matvec(self, q: np.ndarray, s: np.ndarray, code: int, x: np.ndarray, out: np.ndarray) -> None:
        fn = self._serial if q.nbytes + s.nbytes < PARALLEL_MIN_BYTES else self._parallel
        fn(q, s, tag(code), *packed.quantize_x(x), out)


def _rebound(dispatcher, **names) -> types.FunctionType:
    """A compiled function's Python source with some of its globals replaced (to compile it again with them)."""
    py = dispatcher.py_func
    return types.FunctionType(py.__code__, {**py.__globals__, **names}, py.__name__, py.__defaults__, py.__closure__)


@numba.njit(parallel=True, nogil=True)
def plain_read(q, s, out):
    """XOR of every 8 bytes of a packed weight's q and s, one row group per parallel iteration as `matvec`
    splits them: the same bytes in the same order with no arithmetic, the streaming ceiling of a product."""
    qf = q.reshape(q.shape[0], -1).view(np.uint64)
    sf = s.reshape(s.shape[0], -1)
    for g in numba.prange(q.shape[0]):
        t = np.uint64(0)
        for i in range(qf.shape[1]):
            t ^= qf[g, i]
        for i in range(sf.shape[1]):
            t ^= np.uint64(sf[g, i])
        out[g % out.shape[0]] = np.float32(t & np.uint64(1))


def timed(fn, n: int) -> tuple[float, float]:
    """(wall, cpu) seconds per call over n calls."""
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n, (time.process_time() - c) / n


def race(variants: dict, rounds: int, budget_s: float) -> dict[str, tuple[float, float]]:
    """Best (wall, cpu) per call of each variant, timed in alternating rounds."""
    n = {}
    for name, fn in variants.items():
        fn()  # compile, pack
        w, _ = timed(fn, 1)
        n[name] = max(1, int(budget_s / max(w, 1e-6)))
    best = {name: (np.inf, np.inf) for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            w, c = timed(fn, n[name])
            best[name] = (min(best[name][0], w), min(best[name][1], c))
    return best


def bench_shapes(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    print(
        f"{'type':5s} {'rows×cols':>12s} {'MB':>6s}  {'old GB/s':>8s} {'(cpu)':>7s}  {'new GB/s':>8s} {'(cpu)':>7s}  "
        f"{'new µs':>8s} {'×':>5s}  pack GB/s"
    )
    for qtype, shapes in SHAPES.items():
        if args.formats and qtype.name not in args.formats:
            continue
        code = BLOCK_CODES[qtype]
        for rows, cols in shapes:
            raw = random_weight(qtype, rows, cols, rng)
            copies = max(1, -(-2 * L3_BYTES // raw.nbytes)) if args.cold else 1
            raws = [raw] + [random_weight(qtype, rows, cols, rng) for _ in range(copies - 1)]
            ws = [WeightMatrix.from_raw("bench", qtype, rows, cols, r) for r in raws]
            t = time.perf_counter()
            for w in ws:
                w.prepare()
            pack_s = (time.perf_counter() - t) / copies
            x = rng.standard_normal(cols).astype(np.float32)
            out = np.empty(rows, dtype=np.float32)
            it = {"old": 0, "new": 0}
            olds = [] if args.no_old else [args.old.pack(code, rows, cols, r) for r in raws]

            def old(it=it, olds=olds, x=x, out=out, code=code):
                it["old"] = (it["old"] + 1) % len(olds)
                args.old.matvec(*olds[it["old"]], code, x, out)

            def new(it=it, ws=ws, x=x, out=out):
                it["new"] = (it["new"] + 1) % len(ws)
                matvec(ws[it["new"]], x, out)

            variants = {"new": new} if args.no_old else {"old": old, "new": new}
            best = race(variants, args.rounds, args.budget)
            mb = raw.nbytes / 1e6
            nw, nc = best["new"]
            cells = []
            for name in ("old", "new"):
                if name in best:
                    w, c = best[name]
                    cells.append(f"{mb / 1e3 / w:8.2f} {mb / 1e3 / c:7.2f}")
                else:
                    cells.append(f"{'-':>8s} {'-':>7s}")
            speedup = f"{best['old'][0] / nw:5.1f}" if "old" in best else "    -"
            pack = f"{mb / 1e3 / pack_s:6.2f}" if ws[0].packed is not None else "     -"
            shape = f"{rows:>5d}×{cols:<6d}"
            print(f"{qtype.name:5s} {shape} {mb:6.2f}  {cells[0]}  {cells[1]}  {nw * 1e6:8.1f} {speedup}  {pack}")


def bench_launch(args: argparse.Namespace) -> None:
    """Per-call cost of a product too small to matter: Python wrapper + dispatch + parallel launch."""
    rng = np.random.default_rng(1)
    w = WeightMatrix.from_raw("tiny", T.Q8_0, 64, 64, random_weight(T.Q8_0, 64, 64, rng))
    x = rng.standard_normal(64).astype(np.float32)
    out = np.empty(64, dtype=np.float32)
    best = race({"tiny": lambda: matvec(w, x, out)}, args.rounds, args.budget)
    wall, cpu_s = best["tiny"]
    print(f"per-call overhead (64×64 Q8_0 matvec): {wall * 1e6:.1f} µs wall, {cpu_s * 1e6:.1f} µs cpu")
    # q, k, v of SmolLM2 and gate, up of Qwen2.5: one launch or several
    for qtype, shapes in [(T.Q4_1, [(576, 576), (192, 576), (192, 576)]), (T.Q5_0, [(4864, 896), (4864, 896)])]:
        ws = [WeightMatrix.from_raw("m", qtype, r, c, random_weight(qtype, r, c, rng)) for r, c in shapes]
        x = rng.standard_normal(shapes[0][1]).astype(np.float32)
        best = race(
            {"separate": lambda ws=ws, x=x: [matvec(w, x) for w in ws], "many": lambda ws=ws, x=x: matvec_many(ws, x)},
            args.rounds,
            args.budget,
        )
        desc = " + ".join(f"{r}×{c}" for r, c in shapes)
        sep, many = best["separate"][0] * 1e6, best["many"][0] * 1e6
        print(f"{qtype.name} {desc}: separate {sep:.1f} µs, matvec_many {many:.1f} µs")


def bench_prefill(args: argparse.Namespace) -> None:
    """Prompt products: tile-dequantize + BLAS (the old path, `exact=True`) against the int8 kernels."""
    rng = np.random.default_rng(2)
    print(f"{'prefill':18s} {'tokens':>6s}  {'BLAS ms':>8s}  {'int8 ms':>8s}  {'×':>5s}")
    for qtype, rows, cols in [(T.Q4_1, 1536, 576), (T.Q5_0, 4864, 896), (T.Q6_K, 896, 4864)]:
        w = WeightMatrix.from_raw("p", qtype, rows, cols, random_weight(qtype, rows, cols, rng)).prepare()
        for t in (8, 64, 256):
            xs = rng.standard_normal((t, cols)).astype(np.float32)
            best = race(
                {"blas": lambda w=w, xs=xs: matmul(w, xs, exact=True), "int8": lambda w=w, xs=xs: matmul(w, xs)},
                args.rounds,
                args.budget,
            )
            b, i = best["blas"][0], best["int8"][0]
            print(f"{qtype.name:5s} {rows:>5d}×{cols:<6d} {t:6d}  {b * 1e3:8.2f}  {i * 1e3:8.2f}  {b / i:5.1f}")


def bench_model(args: argparse.Namespace) -> None:
    """Every decode product of a real model (one token), packed from the file; and the load cost."""
    from engine.gguf_file import open_gguf  # noqa: PLC0415

    t = time.perf_counter()
    f = open_gguf(args.model)
    print(f"{Path(args.model).name}: opened in {time.perf_counter() - t:.1f} s")
    names = [n for n, e in f.tensors.items() if len(e.shape) == 2 and n != "token_embd.weight"]
    if "output.weight" not in f.tensors:
        names.append("token_embd.weight")  # tied output
    ws, olds = [], []
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t, c = time.perf_counter(), time.process_time()
    for n in names:
        e = f.tensors[n]
        w = WeightMatrix.from_raw(n, e.ggml_type, e.shape[1], e.shape[0], e.data)
        if not args.no_old:  # before prepare() releases the file pages
            olds.append(args.old.pack(BLOCK_CODES[w.ggml_type], w.rows, w.cols, w.data))
        ws.append(w.prepare())
    pack_wall, pack_cpu = time.perf_counter() - t, time.process_time() - c
    total = sum(w.data.nbytes for w in ws)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"packed {len(ws)} matrices, {total / 1e6:.0f} MB, in {pack_wall:.2f} s ({pack_cpu:.2f} s cpu); "
        f"peak RSS {rss / 1024:.0f} MB (+{(rss - rss0) / 1024:.0f} MB while packing)"
    )
    xs = {w.cols: np.random.default_rng(0).standard_normal(w.cols).astype(np.float32) for w in ws}
    outs = [np.empty(w.rows, dtype=np.float32) for w in ws]

    def products(idx: list[int]) -> dict:
        def new():
            for i in idx:
                matvec(ws[i], xs[ws[i].cols], outs[i])

        def old():
            for i in idx:
                args.old.matvec(*olds[i], BLOCK_CODES[ws[i].ggml_type], xs[ws[i].cols], outs[i])

        def read():
            for i in idx:
                plain_read(ws[i].packed.q, ws[i].packed.s, outs[i])

        return {"new": new, "read": read} if args.no_old else {"old": old, "new": new, "read": read}

    def report(label: str, nbytes: int, best: dict) -> None:
        cells = [
            f"{name} {args.isa[name]} {w * 1e3:7.2f} ms {nbytes / w / 1e9:6.2f} GB/s (cpu {nbytes / c / 1e9:6.2f})"
            for name, (w, c) in best.items()
        ]
        ratio = f"  new/old {best['old'][0] / best['new'][0]:.2f}x" if "old" in best else ""
        ratio += f"  new/read {best['read'][0] / best['new'][0]:.2f}x"
        print(f"  {label}: " + "; ".join(cells) + ratio)

    every = list(range(len(ws)))
    best = race(products(every), args.rounds, max(args.budget, 0.5))
    report(f"one token's {len(ws)} matvecs, {total / 1e6:.0f} MB", total, best)
    print(f"  -> {1 / best['new'][0]:.1f} tok/s upper bound (new)")
    by_type: dict[str, list[int]] = {}
    for i, wm in enumerate(ws):
        by_type.setdefault(wm.ggml_type.name, []).append(i)
    for name, idx in by_type.items():
        gb = sum(ws[i].data.nbytes for i in idx)
        report(f"{name:5s} {len(idx):4d} matrices {gb / 1e6:7.1f} MB", gb, race(products(idx), args.rounds, 0.3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.2, help="seconds per variant per round")
    ap.add_argument("--cold", action="store_true", help="rotate weights past the L3 cache")
    ap.add_argument("--formats", type=lambda s: s.split(","), default=None)
    ap.add_argument("--no-old", action="store_true", help="skip the old kernels")
    ap.add_argument("--against", default="avx2", help="the old kernel set: avx2 (default), avxvnni, ..., portable")
    ap.add_argument("--model", help="time every decode matrix of this GGUF file")
    ap.add_argument("--skip-launch", action="store_true")
    ap.add_argument("--prefill", action="store_true", help="also time prompt products (matmul)")
    args = ap.parse_args()
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    args.old = None if args.no_old else OtherKernels(args.against)
    args.isa = {"new": simd.KERNELS.isa, "old": args.against, "read": "plain read"}
    print(
        f"threads {numba.get_num_threads()}, load average {os.getloadavg()[0]:.1f} (1 min) / "
        f"{os.getloadavg()[1]:.1f} (5 min); new = {simd.KERNELS.isa} on {simd.TARGET_NAME}, old = {args.against}"
    )
    if args.model:
        bench_model(args)
        return
    if not args.skip_launch:
        bench_launch(args)
    bench_shapes(args)
    if args.prefill:
        bench_prefill(args)
    print(f"threading layer {numba.threading_layer()}")


if __name__ == "__main__":
    main()
