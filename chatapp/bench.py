"""`chatapp bench`: llama-bench style prefill (pp) and decode (tg) speed, mean ± std over repetitions, on the
model's device (CPU, or the GPU offload of `--device` / `--gpu-layers`).

On the CPU it also reports how close decode comes to the memory-bandwidth limit: each token reads every weight
matrix once, so decode tok/s × bytes per token is the weights' read rate, set against the machine's own read
bandwidth measured in the same run (a parallel read of 1 GiB with the kernels' thread count)."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from engine import Model


def measure(model: Model, n_prompt: int, n_gen: int, seed: int = 0) -> tuple[float, float]:
    """One repetition in a fresh session: (prefill tok/s, decode tok/s) on random tokens, greedy."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.n_vocab, size=n_prompt).tolist()
    session = model.session()
    t0 = time.perf_counter()
    logits = session.eval(prompt)
    pp = n_prompt / (time.perf_counter() - t0)
    t1 = time.perf_counter()
    for _ in range(n_gen):
        logits = session.eval([int(np.argmax(logits))])
    tg = n_gen / (time.perf_counter() - t1)
    return pp, tg


def weight_bytes_per_token(model: Model) -> int:
    """File bytes of the matrices one decoded token reads: every 2-D tensor but the token embedding, of which a
    token reads one row (unless it is also the output matrix)."""
    tensors = model.file.tensors
    tied = "output.weight" not in tensors
    return sum(
        t.data.nbytes for name, t in tensors.items() if len(t.shape) == 2 and (tied or name != "token_embd.weight")
    )


def run_bench(model: Model, n_prompt: int, n_gen: int, repetitions: int, as_json: bool) -> int:
    if n_prompt + n_gen > model.n_ctx:
        raise ValueError(f"-p {n_prompt} + -n {n_gen} exceed the context of {model.n_ctx}; raise -c")
    measure(model, min(n_prompt, 8), min(n_gen, 2))  # warm-up: page in the weights
    runs = [measure(model, n_prompt, n_gen, seed=r) for r in range(max(1, repetitions))]
    pp = [r[0] for r in runs]
    tg = [r[1] for r in runs]
    result = {
        "model": model.name,
        "file": str(model.file.path),
        "threads": model.threads,
        "device": getattr(model, "device", "cpu"),
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "repetitions": len(runs),
        "prefill_tok_s": statistics.mean(pp),
        "prefill_tok_s_std": statistics.pstdev(pp),
        "decode_tok_s": statistics.mean(tg),
        "decode_tok_s_std": statistics.pstdev(tg),
        "load_s": model.load_s,
    }
    if result["device"] == "cpu":
        from engine.kernels.memory import read_bandwidth

        per_token = weight_bytes_per_token(model)
        bandwidth = read_bandwidth()
        result["weights_mb_per_token"] = per_token / 1e6
        result["decode_weights_gb_s"] = per_token * result["decode_tok_s"] / 1e9
        result["read_bandwidth_gb_s"] = bandwidth / 1e9
        result["bandwidth_pct"] = 100 * result["decode_weights_gb_s"] / result["read_bandwidth_gb_s"]
    if as_json:
        print(json.dumps(result, indent=1))
        return 0
    print("| model | device | threads | test | t/s |\n|---|---|---|---|---|")
    for test, key in ((f"pp{n_prompt}", "prefill_tok_s"), (f"tg{n_gen}", "decode_tok_s")):
        rate = f"{result[key]:.2f} ± {result[key + '_std']:.2f}"
        print(f"| {model.name} | {result['device']} | {model.threads} | {test} | {rate} |")
    if "bandwidth_pct" in result:
        print(
            f"decode reads {result['weights_mb_per_token']:.0f} MB of weights per token: "
            f"{result['decode_weights_gb_s']:.1f} GB/s, {result['bandwidth_pct']:.0f}% of the "
            f"{result['read_bandwidth_gb_s']:.1f} GB/s this machine read (1 GiB, {model.threads} threads)"
        )
    return 0
