"""Speculative decoding and saved KV caches, measured through the chat layer.

    python benchmarks/speculative.py -m qwen2.5-coder-0.5b-instruct [-md DRAFT] [-n 128] [-r 3] [--json OUT]

Named prompts (greedy, the model's chat template):
- `rewrite`: "rewrite this code with one change" over a 40-line Python module (REWRITE_CODE below): the reply
  repeats most of the prompt, the case prompt lookup is for.
- `code`: new code from a one-line request (merging intervals): what a draft model is for, since the reply
  repeats little of the prompt but is predictable to a smaller model of the same family.
- `fresh`: a short request whose reply repeats nothing of the prompt (lookup finds few matches).
For each prompt: plain decode, `--lookup` (paced, as the app runs it), `misses` (prompt lookup whose every
guess is wrong, paced the same way: the worst case of a prompt where nothing matches, which the pacing must keep
near plain speed) and, with -md, the draft model and the two together (`lookup + draft`: lookup's guesses where
the chat has a match, the model's elsewhere); decode
tok/s is the median of the repetitions, and every drafted reply is checked against the plain one token for token.
`pass_ms`: the fastest of 7 target passes over 1, 2, 4, 8 and 16 tokens: with tokens per pass, what a drafted
step costs against a plain one, the least load-dependent figure here.
`resume`: a ~1,500-token conversation saved with its KV cache, then restored into a new session; the time to
read and check the file against the prompt's prefill.

With --llama-python (an interpreter with llama-cpp-python), llama.cpp's own plain greedy decode of each prompt's
token ids on the same file and threads runs after each repetition, in a fresh process: the drafted decode
against it, as a ratio of medians.

Each figure is printed with the machine's load average (os.getloadavg) before and after it: on a shared machine
the figures are only as good as that load says.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatapp.catalog import resolve_model  # noqa: E402
from engine import load_model  # noqa: E402
from engine.chat import ChatSession  # noqa: E402
from engine.events import Message, TurnStats  # noqa: E402
from engine.kv_store import KVStore  # noqa: E402
from engine.requantize import parse_type  # noqa: E402
from engine.sampling import SamplingSettings  # noqa: E402
from engine.speculative import CombinedDrafter, LookupDrafter, ModelDrafter  # noqa: E402

REWRITE_CODE = """import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Item:
    name: str
    price: float
    quantity: int

    def total(self) -> float:
        return self.price * self.quantity


def load_items(path: Path) -> list[Item]:
    with open(path) as f:
        rows = json.load(f)
    items = []
    for row in rows:
        items.append(Item(row["name"], float(row["price"]), int(row["quantity"])))
    return items


def order_total(items: list[Item]) -> float:
    total = 0.0
    for item in items:
        total += item.total()
    return total


def cheapest(items: list[Item]) -> Item | None:
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best


def save_items(items: list[Item], path: Path) -> None:
    rows = [{"name": i.name, "price": i.price, "quantity": i.quantity} for i in items]
    with open(path, "w") as f:
        json.dump(rows, f, indent=2)
"""

PROMPTS = {
    "rewrite": [
        Message(
            "user",
            "Rewrite this module with the class Item renamed to Product everywhere. Reply with the whole code "
            "and nothing else.\n\n```python\n" + REWRITE_CODE + "```",
        )
    ],
    "code": [
        Message(
            "user",
            "Write a Python function that merges overlapping intervals given as a list of (start, end) tuples, "
            "with type hints, a docstring and a few doctest examples.",
        )
    ],
    "fresh": [Message("user", "Write a short poem about a lighthouse in winter.")],
}


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def turn(chat: ChatSession, messages: list[Message]) -> tuple[list[int], TurnStats]:
    events = list(chat.stream_reply(messages))
    stats = events[-1]
    assert isinstance(stats, TurnStats)
    return [e.token_id for e in events[:-1]], stats


class MissingLookup(LookupDrafter):
    """Prompt lookup's length and pacing, guessing a token the reply never holds (the vocabulary's last id, a
    padding or control token): every guess is checked and rejected."""

    def __init__(self, miss: int) -> None:
        super().__init__(paced=True)
        self.miss = miss
        self.guessing_passes = 0  # target passes that checked a guess (each rejected)

    def draft(self, context, limit: int) -> list[int]:
        n = min(limit, self.length.now)
        if n <= 0 or (self.pace is not None and not self.pace.allow()):
            return []
        self.guessing_passes += 1
        return [self.miss] * n


def decode_figures(model, modes: dict, messages, n_gen: int, reps: int, llama_python: str | None = None) -> dict:
    """Each repetition runs every mode back to back (plain first), so that the machine's drifting load falls on
    all of them alike; a mode's speed-up is the median of its per-repetition ratios to plain."""
    settings = SamplingSettings(temperature=0.0, max_tokens=n_gen)
    runs: dict[str, list] = {name: [] for name in modes}
    guessing: dict[str, list[int]] = {name: [] for name in modes}
    llama: list[float] = []
    prompt = ChatSession(model, settings).prompt_tokens(messages) if llama_python else []
    for _ in range(reps):
        for name, factory in modes.items():
            before = load()
            drafter = factory() if factory else None
            chat = ChatSession(model, settings, drafter=drafter)
            ids, stats = turn(chat, messages)
            runs[name].append((ids, stats, before, load()))
            guessing[name].append(getattr(drafter, "guessing_passes", -1))
        if llama_python:
            llama.append(llama_cpp_plain(llama_python, model, prompt, n_gen))
    out = {}
    plain_ids = runs["plain"][-1][0]
    for name, rows in runs.items():
        stats = [r[1] for r in rows]
        ratios = [s.decode_tok_s / p[1].decode_tok_s for s, p in zip(stats, runs["plain"], strict=True)]
        out[name] = {
            "decode_tok_s": statistics.median(s.decode_tok_s for s in stats),
            "runs": [s.decode_tok_s for s in stats],
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "tokens": stats[-1].generated_tokens,
            "acceptance": stats[-1].acceptance_rate,
            "tokens_per_pass": stats[-1].tokens_per_pass,
            "same_as_plain": all(r[0] == plain_ids for r in rows),
            "load": [f"{r[2]} -> {r[3]}" for r in rows],
            "guessing_passes": guessing[name],
        }
        if llama:
            out[name]["vs_llama_cpp"] = out[name]["decode_tok_s"] / statistics.median(llama)
    if llama:
        out["llama.cpp plain"] = {"decode_tok_s": statistics.median(llama), "runs": llama}
    return out


LLAMA_PLAIN = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, threads, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.argv[4])
llm = Llama(model_path=path, n_ctx=len(prompt) + n_gen + 8, n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False)
llm.eval(prompt)
t = time.perf_counter()
for _ in range(n_gen - 1):  # the first token comes from the prompt's logits, as in our decode_tok_s
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
print(json.dumps({"decode_tok_s": (n_gen - 1) / (time.perf_counter() - t)}))
"""


def llama_cpp_plain(python: str, model, prompt: list[int], n_gen: int) -> float:
    """llama.cpp's greedy decode tok/s after `prompt`, in a fresh process of `python`."""
    code = [python, "-c", LLAMA_PLAIN, str(model.file.path), str(model.threads), str(n_gen), json.dumps(prompt)]
    out = subprocess.run(code, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{python} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]


def pass_costs(model, widths=(1, 2, 4, 8, 16), reps: int = 7) -> dict[int, float]:
    """The fastest of `reps` target passes of each width after a 300-token context, interleaved: the minimum is
    what the pass costs when nothing else runs, the figure least moved by a shared machine's load."""
    session = model.session()
    session.eval(list(range(100, 400)))
    best = {w: float("inf") for w in widths}
    for _ in range(reps):
        for w in widths:
            t0 = time.perf_counter()
            session.eval_all(list(range(500, 500 + w)))
            best[w] = min(best[w], time.perf_counter() - t0)
            session.truncate(300)
    return {w: best[w] * 1000 for w in widths}


def resume_figures(model, n_tokens: int) -> dict:
    """Save a conversation of about n_tokens with its cache, restore it into a new session: time both ways."""
    body = (REWRITE_CODE + "\n") * max(1, n_tokens // len(model.tokenize(REWRITE_CODE)))
    messages = [Message("user", "Explain this code.\n\n" + body)]
    with tempfile.TemporaryDirectory() as folder:
        chat = ChatSession(
            model, SamplingSettings(temperature=0.0, max_tokens=1), kv_store=KVStore(Path(folder), 1 << 34)
        )
        before = load()
        _, stats = turn(chat, messages)
        t0 = time.perf_counter()
        path = chat.save_cache()
        save_s = time.perf_counter() - t0
        resumed = ChatSession(
            model, SamplingSettings(temperature=0.0, max_tokens=1), kv_store=KVStore(Path(folder), 1 << 34)
        )
        prompt = resumed.prompt_tokens(messages)
        sha, tpl = resumed._model_key(), resumed._template_key()  # the sha256 is remembered from the save
        t1 = time.perf_counter()
        restored = resumed.kv_store.restore(resumed.session, sha, tpl, prompt[:-1])
        restore_s = time.perf_counter() - t1
        # Again into the same (now paged-in) cache: the first restore also pays the first touch of a freshly
        # allocated KV cache, which a prefill into it pays as well.
        resumed.session.truncate(0)
        t2 = time.perf_counter()
        resumed.kv_store.restore(resumed.session, sha, tpl, prompt[:-1])
        warm_s = time.perf_counter() - t2
        return {
            "prompt_tokens": stats.prompt_tokens,
            "prefill_s": stats.prefill_ms / 1000,
            "restored_tokens": restored,
            "file_mb": path.stat().st_size / 1e6,
            "save_s": save_s,
            "restore_s": restore_s,
            "restore_warm_s": warm_s,
            "load_before": before,
            "load_after": load(),
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", action="append", required=True)
    p.add_argument("-md", "--model-draft")
    p.add_argument(
        "--draft-type", default="file",
        help="the draft's weights at load, as the app's --draft-type; comma-separated to compare (q4_0,file)",
    )  # fmt: skip
    p.add_argument("--prompt", action="append", choices=sorted(PROMPTS), help="only these prompts (default: all)")
    p.add_argument("--skip-lookup", action="store_true", help="no lookup or misses runs (the draft model only)")
    p.add_argument("-n", type=int, default=128)
    p.add_argument("-r", type=int, default=3)
    p.add_argument("--resume-tokens", type=int, default=1500)
    p.add_argument("--json")
    p.add_argument("--skip-decode", action="store_true", help="only the pass costs and the resume figures")
    p.add_argument("--llama-python", help="an interpreter with llama-cpp-python: its plain decode of each prompt")
    args = p.parse_args()
    results = {}
    for spec in args.model:
        model = load_model(resolve_model(spec), n_ctx=4096)
        drafts = {}  # mode name -> draft model, one per --draft-type
        for i, kind in enumerate(args.draft_type.split(",") if args.model_draft else ()):
            draft = load_model(resolve_model(args.model_draft), n_ctx=4096, requantize=parse_type(kind))
            drafts["draft" if i == 0 else f"draft {kind}"] = draft
            print(f"draft {draft.name}: {kind} ({draft.requantized or 'as stored'})", flush=True)
        prompts = {name: PROMPTS[name] for name in args.prompt or PROMPTS}
        out = results[model.name] = {}
        for name, messages in () if args.skip_decode else prompts.items():
            modes = {"plain": None}
            if not args.skip_lookup:
                modes["lookup"] = lambda: LookupDrafter(paced=True)
                modes["misses"] = lambda m=model: MissingLookup(m.n_vocab - 1)
            for mode, draft in drafts.items():
                modes[mode] = lambda d=draft, m=model: ModelDrafter(d, m, paced=True)
                if not args.skip_lookup:  # `--lookup -md`: lookup's guesses first, the model's elsewhere
                    modes[f"lookup + {mode}"] = lambda d=draft, m=model: CombinedDrafter(
                        LookupDrafter(paced=True), ModelDrafter(d, m, paced=True)
                    )
            row = out[name] = decode_figures(model, modes, messages, args.n, args.r, args.llama_python)
            if "llama.cpp plain" in row:
                fig = row.pop("llama.cpp plain")
                print(f"{model.name} | {name} | llama.cpp plain: {fig['decode_tok_s']:.1f} tok/s (runs "
                      f"{', '.join(f'{x:.1f}' for x in fig['runs'])})", flush=True)
            for mode, fig in row.items():
                vs = f", {fig['vs_llama_cpp']:.2f}x llama.cpp plain" if "vs_llama_cpp" in fig else ""
                print(
                    f"{model.name} | {name} | {mode}: {fig['decode_tok_s']:.1f} tok/s, {fig['ratio']:.2f}x plain{vs} "
                    f"(runs {', '.join(f'{x:.2f}' for x in fig['ratios'])}), {fig['tokens']} tokens, "
                    f"acceptance {fig['acceptance']:.0%}, {fig['tokens_per_pass']:.2f} tokens/pass, "
                    f"same as plain: {fig['same_as_plain']}, load {'; '.join(fig['load'])}",
                    flush=True,
                )
        costs = out["pass_ms"] = pass_costs(model)
        print(
            f"{model.name} | target pass of 1/2/4/8/16 tokens (fastest of 7): "
            + " / ".join(f"{ms:.1f}" for ms in costs.values())
            + f" ms, load {load()}",
            flush=True,
        )
        # What wrong guesses cost, from counts and the pass costs above rather than from wall-clock ratios
        # that a shared machine's load moves by +-20%: each rejected one-guess pass costs (pass 2 / pass 1 - 1)
        # of a token more than a plain step.
        for name in () if args.skip_decode or args.skip_lookup else prompts:
            fig = out[name]["misses"]
            n = max(fig["guessing_passes"])
            extra = n * (costs[2] / costs[1] - 1) / fig["tokens"]
            print(
                f"{model.name} | {name} | misses: at most {n} guessing passes in {fig['tokens']} tokens: "
                f"{extra:.1%} slower than plain at these pass costs",
                flush=True,
            )
        r = out["resume"] = resume_figures(model, args.resume_tokens)
        print(
            f"{model.name} | resume: {r['restored_tokens']}/{r['prompt_tokens']} tokens restored in "
            f"{r['restore_s']:.3f} s, {r['restore_warm_s']:.3f} s into a paged-in cache (prefill was "
            f"{r['prefill_s']:.2f} s; save {r['save_s']:.3f} s, "
            f"{r['file_mb']:.1f} MB), load {r['load_before']} -> {r['load_after']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
