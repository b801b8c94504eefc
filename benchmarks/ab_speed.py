"""Prefill and decode speed of two engine trees in one process, in interleaved rounds: this checkout's `engine`
against another tree's (a checkout of an earlier commit), on the same models, medians reported.

    git worktree add /tmp/before <commit>    # or: git archive <commit> | tar -x -C /tmp/before
    python benchmarks/ab_speed.py --before /tmp/before MODEL.gguf [MODEL.gguf ...]

Both engines load each model (each packs its own weights) and alternate round by round, which one goes first
alternating too, so that a machine whose speed drifts over minutes (a shared VM) moves both alike. Each round is
`chatapp bench`'s repetition: a fresh session, a prompt of random tokens, then greedy decoding. Then, with
--token-blocks, the one-token pass alone: blocks of 20 passes of one token at a fixed position (the same cache
row rewritten), alternating between the engines; the fastest block is the least disturbed by other load.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from chatapp.bench import measure  # noqa: E402


def load_tree(tree: Path, name: str) -> ModuleType:
    """The `engine` package of another tree, imported as `name` (its relative imports stay inside it)."""
    init = tree / "engine" / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"no engine package in {tree}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--before", type=Path, required=True, help="the other tree (its engine/ is 'before')")
    parser.add_argument("-p", "--n-prompt", type=int, default=256)
    parser.add_argument("-n", "--n-gen", type=int, default=64)
    parser.add_argument("-r", "--rounds", type=int, default=5)
    parser.add_argument("-t", "--threads", type=int, default=None)
    parser.add_argument("--token-blocks", type=int, default=0, help="blocks of 20 one-token passes per engine")
    args = parser.parse_args()
    engines = {"after": importlib.import_module("engine"), "before": load_tree(args.before, "engine_before")}
    results = []
    for path in args.models:
        models = {
            label: e.load_model(path, n_ctx=args.n_prompt + args.n_gen, threads=args.threads, compile_kernels=False)
            for label, e in engines.items()
        }
        for m in models.values():  # compile or load the kernels, page the weights in
            measure(m, args.n_prompt, 4)
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label in models}
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for label in order:
                runs[label].append(measure(models[label], args.n_prompt, args.n_gen, seed=r))
                pp, tg = runs[label][-1]
                print(f"{path.name} round {r} {label}: pp{args.n_prompt} {pp:.1f} tg{args.n_gen} {tg:.1f}", flush=True)
        per_token: dict[str, list[float]] = {label: [] for label in models}
        sessions = {label: m.session() for label, m in models.items()}
        for session in sessions.values():
            session.eval(list(range(100, 116)))
        for r in range(args.token_blocks):
            for label in list(models) if r % 2 == 0 else list(reversed(models)):
                t0 = time.perf_counter()
                for _ in range(20):
                    models[label].forward(np.array([42]), sessions[label].cache, 16, last_only=True)
                per_token[label].append((time.perf_counter() - t0) / 20 * 1e3)
        for label, rows in runs.items():
            if per_token[label]:
                results.append(
                    {
                        "model": path.name,
                        "engine": label,
                        "one_token_ms_min": min(per_token[label]),
                        "one_token_ms_median": statistics.median(per_token[label]),
                    }
                )
            results.append(
                {
                    "model": path.name,
                    "engine": label,
                    "threads": models[label].threads,
                    "prefill_tok_s_median": statistics.median(pp for pp, _ in rows),
                    "decode_tok_s_median": statistics.median(tg for _, tg in rows),
                    "prefill_tok_s_runs": [round(pp, 1) for pp, _ in rows],
                    "decode_tok_s_runs": [round(tg, 1) for _, tg in rows],
                }
            )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
