"""The GPU offload on a real GPU: parity with the CPU engine, prefill and decode speed, device memory.

    .venv/bin/python benchmarks/gpu_check.py MODEL.gguf [MODEL.gguf ...] [--gpu-layers -1] [--json]

For each model: load it on the CPU and on `cuda` (every layer and the output head by default); teacher-force a
fixed English text through both and compare next-token log-probs (top-1 agreement, the GPU's top-1 within the
CPU's top-5, mean |Δ log-prob| of the CPU's top-1; the same against the CPU engine with float products, which
should agree to rounding); then time a 256-token prefill and 64 greedy decode steps on the GPU, and read the
device memory (CuPy's pool and the device's own count). Prints a markdown table, or JSON with --json.
Without CuPy or a CUDA device it says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from chatapp.bench import measure  # noqa: E402
from engine import EngineError, load_model  # noqa: E402
from engine.gpu import find_cuda  # noqa: E402
from engine.kernels import float_products  # noqa: E402

TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
    "built two-wheeled machines that riders pushed along with their feet. Pedals came later, attached to the "
    "front wheel, and the chain drive that turns the rear wheel arrived only in the 1880s."
)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def parity(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """ref, got: logits (n, n_vocab) at the same positions."""
    lp_ref, lp_got = log_softmax(ref), log_softmax(got)
    n = len(lp_ref)
    top1_ref, top1_got = lp_ref.argmax(-1), lp_got.argmax(-1)
    top5_ref = np.argsort(-lp_ref, axis=-1)[:, :5]
    return {
        "top1_agreement": float(np.mean(top1_ref == top1_got)),
        "top1_in_top5": float(np.mean([top1_got[i] in top5_ref[i] for i in range(n)])),
        "mean_abs_dlp": float(np.abs(lp_ref[np.arange(n), top1_ref] - lp_got[np.arange(n), top1_ref]).mean()),
    }


def memory(cupy) -> dict[str, float]:
    """Device memory in MiB: CuPy's pool (used by arrays, held) and the device's own used/total."""
    pool = cupy.get_default_memory_pool()
    free, total = cupy.cuda.Device(0).mem_info
    mib = 1 << 20
    return {
        "pool_used_mib": pool.used_bytes() / mib,
        "pool_held_mib": pool.total_bytes() / mib,
        "device_used_mib": (total - free) / mib,
        "device_total_mib": total / mib,
    }


def check(path: str, gpu_layers: int, n_ctx: int, n_prompt: int, n_gen: int, cupy) -> dict[str, Any]:
    cpu = load_model(path, n_ctx=n_ctx, device="cpu")
    ids = cpu.tokenize(TEXT, special=False)
    if cpu.tokenizer.add_bos and cpu.tokenizer.bos_id is not None:
        ids.insert(0, cpu.tokenizer.bos_id)
    ref = cpu.logits(ids)
    with float_products():
        ref_float = cpu.logits(ids)
    before = memory(cupy)
    gpu = load_model(path, n_ctx=n_ctx, device="cuda", gpu_layers=gpu_layers)
    loaded = memory(cupy)
    got = gpu.logits(ids)
    measure(gpu, min(16, n_prompt), 2)  # warm-up: kernels compiled, pool grown (logits come back to the host
    pp, tg = measure(gpu, n_prompt, n_gen)  # after every eval, so each timing ends with the device's work done)
    after = memory(cupy)
    offload = gpu.offload
    return {
        "model": gpu.name,
        "file": str(Path(path).name),
        "device": gpu.device,
        "load_s": gpu.load_s,
        "tokens_compared": len(ids),
        "vs_cpu": parity(ref, got),
        "vs_cpu_float": parity(ref_float, got),
        "prefill_tok_s": pp,
        "decode_tok_s": tg,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "weights_on_device_mib": (offload.nbytes if offload is not None else 0) / (1 << 20),
        "file_mib": Path(path).stat().st_size / (1 << 20),
        "memory_before_load": before,
        "memory_after_load": loaded,
        "memory_after_run": after,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="paths to .gguf files")
    parser.add_argument("--gpu-layers", type=int, default=-1, help="as chatapp's --gpu-layers (default: all)")
    parser.add_argument("-c", "--ctx-size", type=int, default=1024)
    parser.add_argument("-p", "--n-prompt", type=int, default=256)
    parser.add_argument("-n", "--n-gen", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    backend, why = find_cuda()
    if backend is None:
        print(f"gpu_check: no GPU: {why}", file=sys.stderr)
        return 2
    rows = []
    for path in args.models:
        try:
            rows.append(check(path, args.gpu_layers, args.ctx_size, args.n_prompt, args.n_gen, backend.xp))
        except (EngineError, OSError) as e:
            print(f"gpu_check: {path}: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        "| model | device | top-1 agree | top-1 in CPU top-5 | mean abs Δlp | Δlp vs CPU float | "
        f"pp{args.n_prompt} tok/s | tg{args.n_gen} tok/s | weights MiB | pool MiB | device used MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        v, f, m = r["vs_cpu"], r["vs_cpu_float"], r["memory_after_run"]
        print(
            f"| {r['model']} | {r['device']} | {v['top1_agreement']:.3f} | {v['top1_in_top5']:.3f} | "
            f"{v['mean_abs_dlp']:.4f} | {f['mean_abs_dlp']:.5f} | {r['prefill_tok_s']:.1f} | "
            f"{r['decode_tok_s']:.1f} | {r['weights_on_device_mib']:.0f} | {m['pool_used_mib']:.0f} | "
            f"{m['device_used_mib']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
