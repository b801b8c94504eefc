"""`chatapp bench`: llama-bench style prefill (pp) and decode (tg) speed, mean ± std over repetitions, on the
model's device (CPU, or the GPU offload of `--device` / `--gpu-layers`)."""

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
    if as_json:
        print(json.dumps(result, indent=1))
        return 0
    print("| model | device | threads | test | t/s |\n|---|---|---|---|---|")
    for test, key in ((f"pp{n_prompt}", "prefill_tok_s"), (f"tg{n_gen}", "decode_tok_s")):
        rate = f"{result[key]:.2f} ± {result[key + '_std']:.2f}"
        print(f"| {model.name} | {result['device']} | {model.threads} | {test} | {rate} |")
    return 0
