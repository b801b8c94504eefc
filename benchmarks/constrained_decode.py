"""Decode speed with and without a JSON schema constraint, through the chat layer.

    python benchmarks/constrained_decode.py -m qwen2.5-coder-0.5b-instruct [-n 128] [-r 7] [--json OUT]

Greedy, the model's chat template, one prompt that asks for JSON (so both replies are JSON of similar length).
`plain` decodes it free; `schema` under SCHEMA below. The two runs alternate (A B A B ...) in one process and the
figures are medians over the repetitions:
- ms/token: decode time over generated tokens (TurnStats.decode_ms / generated_tokens), forward passes included;
- sample ms: the sampler side per token (TokenEvent.sample_ms), which is where the grammar's mask is computed
  and applied: the constraint's whole cost, measured without the forward pass's noise.
- paired: the median over repetitions of (schema run / the plain run just before it), ms per token.
The load average is printed beside the figures: on a shared machine they are only as good as that load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatapp.catalog import resolve_model  # noqa: E402
from engine import load_model  # noqa: E402
from engine.chat import ChatSession  # noqa: E402
from engine.constraint import GrammarSpec, compile_grammar  # noqa: E402
from engine.events import Message, TokenEvent, TurnStats  # noqa: E402
from engine.sampling import SamplingSettings  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
        "description": {"type": "string"},
        "dependencies": {"type": "array", "items": {"type": "object", "properties": {
            "package": {"type": "string"}, "minimum_version": {"type": "string"}, "optional": {"type": "boolean"},
        }, "required": ["package", "minimum_version", "optional"]}},
        "maintainers": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "version", "description", "dependencies", "maintainers"],
}  # fmt: skip
PROMPT = (
    "Write the JSON manifest of a Python web framework package: name, version, a two-sentence description, "
    "six dependencies (package, minimum_version, optional) and three maintainers. JSON only."
)


def run(chat: ChatSession, constraint: GrammarSpec | None) -> tuple[float, float, float, int]:
    """(ms per generated token, median sample ms, median forward ms, tokens) of one greedy reply."""
    samples, forwards, stats = [], [], None
    for event in chat.stream_reply([Message("user", PROMPT)], constraint=constraint):
        if isinstance(event, TokenEvent):
            samples.append(event.sample_ms)
            if event.forward_ms > 0:
                forwards.append(event.forward_ms)
        elif isinstance(event, TurnStats):
            stats = event
    assert stats is not None and stats.generated_tokens > 0
    n = stats.generated_tokens
    return stats.decode_ms / n, statistics.median(samples), statistics.median(forwards[1:]), n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-r", "--repetitions", type=int, default=7)
    p.add_argument("-t", "--threads", type=int)
    p.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = p.parse_args()

    model = load_model(resolve_model(args.model), threads=args.threads)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compile_grammar(model.tokenizer, spec)  # compiled once, as a server's cache would hold it
    chat = ChatSession(model, SamplingSettings(temperature=0.0, max_tokens=args.n_gen))
    run(chat, None)  # warm-up: the prompt's prefill goes into the cache, so each run below is decode only
    results: dict[str, list[tuple[float, float, float, int]]] = {"plain": [], "schema": []}
    load = [os.getloadavg()[0]]
    for _ in range(args.repetitions):
        results["plain"].append(run(chat, None))
        results["schema"].append(run(chat, spec))
    load.append(os.getloadavg()[0])

    out = {"model": model.name, "threads": model.threads if hasattr(model, "threads") else None, "load": load}
    for name, rows in results.items():
        out[name] = {
            "ms_per_token": statistics.median(r[0] for r in rows),
            "sample_ms": statistics.median(r[1] for r in rows),
            "forward_ms": statistics.median(r[2] for r in rows),
            "tokens": statistics.median(r[3] for r in rows),
        }
    plain, schema = out["plain"], out["schema"]
    out["slowdown_pct"] = 100 * (schema["ms_per_token"] / plain["ms_per_token"] - 1)
    # Each schema run against the plain run just before it: the pair shared the machine's load of the moment.
    pairs = [b[0] / a[0] for a, b in zip(results["plain"], results["schema"], strict=True)]
    out["paired_slowdown_pct"] = 100 * (statistics.median(pairs) - 1)
    out["sampler_overhead_pct"] = 100 * (schema["sample_ms"] - plain["sample_ms"]) / plain["ms_per_token"]
    print(f"load average {load[0]:.2f} -> {load[1]:.2f}")
    for name in ("plain", "schema"):
        r = out[name]
        print(
            f"{name:>7}: {r['ms_per_token']:7.2f} ms/token, forward {r['forward_ms']:7.2f} ms, "
            f"sample {r['sample_ms']:.3f} ms, {r['tokens']:.0f} tokens"
        )
    print(f"median of paired ratios: {out['paired_slowdown_pct']:+.1f} %")
    print(f"schema vs plain: {out['slowdown_pct']:+.1f} % per token; the mask's own cost "
          f"{out['sampler_overhead_pct']:+.2f} % of a plain token")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
