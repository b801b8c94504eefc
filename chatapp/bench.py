"""`chatapp bench`: llama-bench style prefill (pp) and decode (tg) speed, mean ± std over repetitions, on the
model's device (CPU, or the GPU offload of `--device` / `--gpu-layers`).

On the CPU it also reports how close decode comes to the memory-bandwidth limit: each token reads every weight
matrix once, so decode tok/s × bytes per token is the weights' read rate, set against the machine's own read
bandwidth measured in the same run (a parallel read of 1 GiB with the kernels' thread count, right after each
repetition: on a shared machine the limit moves as much as the speed).

`--split` (after a prompt of `--depth` tokens) shows where a decoded token's time goes: each part of the
one-token step timed alone on the same state (engine/kernels/token_split.py), the products' read rate against
the read bandwidth, and what is left unaccounted between the parts' sum and the whole step."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import Model
from engine.events import TurnStats

if TYPE_CHECKING:
    from engine.speculative import Drafter


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


def measure_chat(model: Model, prompt: list[int], n_gen: int, drafter: Drafter | None) -> TurnStats:
    """Greedy decode of n_gen tokens after `prompt` through the chat layer (with or without a drafter)."""
    from engine.chat import ChatSession
    from engine.sampling import SamplingSettings

    settings = SamplingSettings(temperature=0.0, max_tokens=n_gen)
    chat = ChatSession(model, settings, drafter=drafter, stop_ids=())  # always n_gen tokens
    stats = list(chat.stream_completion(prompt))[-1]
    assert isinstance(stats, TurnStats)
    return stats


def text_prompt(model: Model, n_prompt: int) -> list[int]:
    """The first n_prompt tokens of engine/sampling.py: code, so that a continuation is natural."""
    ids = model.tokenize((Path(__file__).parent.parent / "engine" / "sampling.py").read_text(), special=False)
    return ids[:n_prompt]


def measure_split(model: Model, depth: int, n_tokens: int = 16, seed: int = 0) -> dict[str, Any]:
    """The split of a decoded token after `depth` random prompt tokens, as a dict of milliseconds per token."""
    from engine.kernels.token_split import split_token

    if depth < 1 or depth + n_tokens + 3 > model.n_ctx:
        raise ValueError(f"--depth {depth} needs a context of {depth + n_tokens + 3}; raise -c")
    rng = np.random.default_rng(seed)
    session = model.session()
    session.eval(rng.integers(0, model.n_vocab, size=depth).tolist())
    s = split_token(session, n_tokens)
    return {
        "depth": s.depth,
        "total_ms": 1e3 * s.total_s,
        "parts_ms": {k: 1e3 * v for k, v in s.parts_s.items()},
        "parts_sum_ms": 1e3 * s.parts_sum_s,
        "unaccounted_ms": 1e3 * s.unaccounted_s,
        "launches": s.launches,
        "launches_ms": 1e3 * s.launch_s,
        "product_mb": s.product_bytes / 1e6,
        "products_gb_s": s.product_bytes / (s.parts_s["products"] + s.parts_s["output head"]) / 1e9,
    }


def print_split(split: dict[str, Any], read_gb_s: float | None) -> None:
    total = split["total_ms"]
    print(f"\nA decoded token at depth {split['depth']}: {total:.2f} ms (median of 16; each part timed alone)")
    print("| part | ms per token | share |\n|---|---|---|")
    for name, ms in split["parts_ms"].items():
        print(f"| {name} | {ms:.3f} | {100 * ms / total:.1f}% |")
    print(f"| (unaccounted: the step's Python, caches) | {split['unaccounted_ms']:.3f} "
          f"| {100 * split['unaccounted_ms'] / total:.1f}% |")  # fmt: skip
    rate = f"{split['products_gb_s']:.1f} GB/s"
    if read_gb_s:
        rate += f", {100 * split['products_gb_s'] / read_gb_s:.0f}% of the {read_gb_s:.1f} GB/s read"
    print(
        f"products + head: {split['product_mb']:.0f} MB at {rate}; of their time, thread wake-ups: "
        f"{split['launches']} launches, {split['launches_ms']:.3f} ms"
    )


def run_bench(
    model: Model, n_prompt: int, n_gen: int, repetitions: int, as_json: bool, drafter: Drafter | None = None,
    split_depth: int | None = None,
) -> int:  # fmt: skip
    if n_prompt + n_gen > model.n_ctx:
        raise ValueError(f"-p {n_prompt} + -n {n_gen} exceed the context of {model.n_ctx}; raise -c")
    measure(model, min(n_prompt, 8), min(n_gen, 2))  # warm-up: page in the weights
    device = getattr(model, "device", "cpu")
    probe = None
    if device == "cpu":
        from engine.kernels.memory import ReadProbe

        probe = ReadProbe()
    runs, limits = [], []
    for r in range(max(1, repetitions)):
        runs.append(measure(model, n_prompt, n_gen, seed=r))
        if probe is not None:  # the machine's read rate right after each repetition, not once for the run
            limits.append(probe.measure(repeats=3))
    pp = [r[0] for r in runs]
    tg = [r[1] for r in runs]
    result: dict[str, Any] = {
        "model": model.name,
        "file": str(model.file.path),
        "threads": model.threads,
        "device": device,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "repetitions": len(runs),
        "prefill_tok_s": statistics.mean(pp),
        "prefill_tok_s_std": statistics.pstdev(pp),
        "decode_tok_s": statistics.mean(tg),
        "decode_tok_s_std": statistics.pstdev(tg),
        "decode_tok_s_runs": tg,
        "load_s": model.load_s,
        "cache_type_k": getattr(model, "cache_type_k", "f16"),  # the KV cache's types (-ctk, -ctv)
        "cache_type_v": getattr(model, "cache_type_v", "f16"),
    }
    if limits:
        per_token = model.weights.decode_bytes()  # as packed: the bytes the kernels stream
        shares = [100 * per_token * rate / limit for rate, limit in zip(tg, limits, strict=True)]
        result["weights_mb_per_token"] = per_token / 1e6
        result["decode_weights_gb_s"] = per_token * result["decode_tok_s"] / 1e9
        result["read_bandwidth_gb_s"] = statistics.median(limits) / 1e9
        result["read_bandwidth_gb_s_runs"] = [b / 1e9 for b in limits]
        result["bandwidth_pct"] = statistics.median(shares)  # each repetition against the read beside it
        result["bandwidth_pct_runs"] = shares
    if drafter is not None:  # plain and drafted decode on the same text prompt, through the chat layer
        prompt = text_prompt(model, n_prompt)
        plain = [measure_chat(model, prompt, n_gen, None).decode_tok_s for _ in range(len(runs))]
        drafted = [measure_chat(model, prompt, n_gen, drafter) for _ in range(len(runs))]
        result |= {
            "drafter": drafter.name,
            "text_decode_tok_s": statistics.mean(plain),
            "text_decode_tok_s_std": statistics.pstdev(plain),
            "draft_decode_tok_s": statistics.mean(s.decode_tok_s for s in drafted),
            "draft_decode_tok_s_std": statistics.pstdev(s.decode_tok_s for s in drafted),
            "draft_acceptance": statistics.mean(s.acceptance_rate for s in drafted),
            "draft_tokens_per_pass": statistics.mean(s.tokens_per_pass for s in drafted),
        }
    if split_depth is not None:
        result["split"] = measure_split(model, split_depth)
    if as_json:
        print(json.dumps(result, indent=1))
        return 0
    print("| model | device | threads | test | t/s |\n|---|---|---|---|---|")
    for test, key in ((f"pp{n_prompt}", "prefill_tok_s"), (f"tg{n_gen}", "decode_tok_s")):
        rate = f"{result[key]:.2f} ± {result[key + '_std']:.2f}"
        print(f"| {model.name} | {result['device']} | {model.threads} | {test} | {rate} |")
    if drafter is not None:
        for test, key in ((f"tg{n_gen} text", "text_decode_tok_s"), (f"tg{n_gen} text, draft", "draft_decode_tok_s")):
            rate = f"{result[key]:.2f} ± {result[key + '_std']:.2f}"
            print(f"| {model.name} | {result['device']} | {model.threads} | {test} | {rate} |")
        print(
            f"draft {drafter.name}: {result['draft_acceptance']:.0%} of guesses accepted, "
            f"{result['draft_tokens_per_pass']:.2f} tokens per target pass"
        )
    print(f"KV cache: K {result['cache_type_k']}, V {result['cache_type_v']}")
    if "bandwidth_pct" in result:
        each = ", ".join(f"{p:.0f}%" for p in result["bandwidth_pct_runs"])
        print(
            f"decode reads {result['weights_mb_per_token']:.0f} MB of weights per token: "
            f"{result['decode_weights_gb_s']:.1f} GB/s; {result['bandwidth_pct']:.0f}% of the machine's read "
            f"bandwidth (median; each repetition against a parallel read of 1 GiB with {model.threads} threads "
            f"right after it: {each}; read {result['read_bandwidth_gb_s']:.1f} GB/s, median)"
        )
    if "split" in result:
        print_split(result["split"], result.get("read_bandwidth_gb_s"))
    return 0
