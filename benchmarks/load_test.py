"""N concurrent streaming clients against `chatapp serve` and llama-cpp-python's server on the same GGUF file.

    python benchmarks/load_test.py -m smollm2-135m-instruct --clients 1,2,4 --requests 4 --max-tokens 32

Each client sends its requests one after another: a chat message of about `--prompt-words` random words (a
different one each time, so no server can answer from a cached prompt), greedy, up to `--max-tokens` tokens
(`--ban-eos`: exactly that many, the end-of-turn banned by `ignore_eos` for ours and `logit_bias` for
llama-cpp-python, whose logit_bias runs in Python and slows it down), streamed with usage. Per server and
client count it records requests/s and generated tokens/s over the wall time of the whole round, and TTFT
p50/p95 as the clients measured it (queueing included). Both servers get the same threads and listen on
127.0.0.1; they run one after the other, never at once. llama-cpp-python's server runs with
`--interrupt_requests False`: by default a new request ends the stream in progress (with [DONE], after a few
tokens), so concurrent clients would get cut replies rather than a queue.

llama-cpp-python comes from the venv the tests build (tests/app/llama_cpp_server.py, CMAKE_ARGS
"-DGGML_NATIVE=OFF"), or from --llama-python PY (e.g. a native build); it is never a project dependency.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import openai  # noqa: E402

WORDS = ("time", "river", "light", "stone", "green", "music", "paper", "window", "city", "house", "north", "cloud")
NO_END = {"ignore_eos": True, "logit_bias": {"0": -100, "2": -100}}  # SmolLM2's <|endoftext|>, <|im_end|>
EXTRA: dict = {}  # the request's extra body: NO_END with --ban-eos


@dataclass
class Round:
    server: str
    clients: int
    requests: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float  # generated tokens of all clients / wall time
    ttft_p50_ms: float
    ttft_p95_ms: float
    tokens: int
    failures: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else float("nan")


def one_request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT ms, completion tokens) of one streamed chat completion."""
    start = time.perf_counter()
    ttft, pieces, usage = None, 0, None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], stream=True, max_tokens=max_tokens,
        temperature=0.0, stream_options={"include_usage": True}, extra_body=EXTRA,
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = (time.perf_counter() - start) * 1000.0
            pieces += 1
        if getattr(chunk, "usage", None):
            usage = chunk.usage
    completion = usage.completion_tokens if usage is not None and usage.completion_tokens else pieces
    return (ttft if ttft is not None else float("nan")), completion


def load_round(url: str, model: str, name: str, clients: int, requests: int, words: int, max_tokens: int) -> Round:
    ttfts: list[float] = []
    tokens = [0]
    failures = [0]
    lock = threading.Lock()

    def client_loop(number: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        rng = random.Random(1000 * clients + number)
        for _ in range(requests):
            prompt = "Continue this list: " + " ".join(rng.choice(WORDS) for _ in range(words))
            try:
                ttft, n = one_request(client, model, prompt, max_tokens)
            except openai.OpenAIError as exc:
                print(f"  {name}: client {number}: {type(exc).__name__}: {exc}", file=sys.stderr)
                with lock:
                    failures[0] += 1
                continue
            with lock:
                ttfts.append(ttft)
                tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = len(ttfts)
    return Round(
        name, clients, done, wall, done / wall, tokens[0] / wall,
        statistics.median(ttfts) if ttfts else float("nan"), percentile(ttfts, 0.95), tokens[0], failures[0],
    )  # fmt: skip


def _wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    """Until /health says the model is loaded (llama-server's endpoint, which chatapp serve has too)."""
    try:
        import httpx2 as httpx  # what this openai release is built on
    except ImportError:  # older openai releases use httpx
        import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not ready in {timeout:.0f} s")


@contextmanager
def chatapp_serve(model: Path, threads: int, slots: int, n_ctx: int, workdir: Path) -> Iterator[str]:
    log = workdir / "chatapp-serve.log"
    cmd = [sys.executable, "-m", "chatapp", "serve", "-m", str(model), "--port", "0", "-a", "model",
           "-t", str(threads), "-np", str(slots), "-c", str(n_ctx), "--queue", "64"]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (found := re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"chatapp serve did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        url = found.group(1)
        _wait_ready(url, process, log)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    found = re.search(r"Model name:\s*(.+)", out)
    return found.group(1).strip() if found else "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct", help="a catalog name or a .gguf path")
    ap.add_argument("--clients", default="1,2,4", help="comma-separated concurrent client counts")
    ap.add_argument("--requests", type=int, default=4, help="requests per client per round")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("--llama-python", help="an interpreter with llama-cpp-python[server] (default: the tests' venv)")
    ap.add_argument("--only", choices=("chatapp", "llama-cpp-python"), help="measure one server")
    ap.add_argument("--json", type=Path, help="also write the rounds here")
    ap.add_argument("--ban-eos", action="store_true", help="every reply exactly --max-tokens long")
    args = ap.parse_args()
    if args.ban_eos:
        EXTRA.update(NO_END)

    from chatapp.catalog import resolve_model

    model = resolve_model(args.model)
    counts = [int(c) for c in args.clients.split(",")]
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.only != "llama-cpp-python":
            with chatapp_serve(model, args.threads, max(counts), args.ctx_size, workdir) as url:
                load_round(url, "model", "warm-up", 1, 1, 8, 4)
                for n in counts:
                    rounds.append(load_round(url, "model", "chatapp serve", n, args.requests, args.prompt_words,
                                             args.max_tokens))  # fmt: skip
                    print(rounds[-1], file=sys.stderr)
        if args.only != "chatapp":
            from tests.app.llama_cpp_server import ensure_server_python, llama_server

            python = Path(args.llama_python) if args.llama_python else ensure_server_python()
            log = workdir / "llama-server.log"
            queue = ("--interrupt_requests", "False")  # queue concurrent requests instead of cutting the running one
            with llama_server(
                python, model, log, alias="model", n_ctx=args.ctx_size, threads=args.threads, extra=queue
            ) as server:
                load_round(server.url, "model", "warm-up", 1, 1, 8, 4)
                for n in counts:
                    rounds.append(load_round(server.url, "model", "llama-cpp-python", n, args.requests,
                                             args.prompt_words, args.max_tokens))  # fmt: skip
                    print(rounds[-1], file=sys.stderr)

    each = f"exactly {args.max_tokens}" if args.ban_eos else f"up to {args.max_tokens}"
    print(f"{model.name}, {args.threads} threads, {cpu_name()}; {args.requests} requests per client, "
          f"~{args.prompt_words}-word prompts, {each} tokens each\n")  # fmt: skip
    print("| server | clients | requests/s | TTFT p50 ms | TTFT p95 ms | tokens/s | failures |")
    print("|---|---|---|---|---|---|---|")
    for r in rounds:
        print(f"| {r.server} | {r.clients} | {r.requests_per_s:.2f} | {r.ttft_p50_ms:.0f} | {r.ttft_p95_ms:.0f} | "
              f"{r.tokens_per_s:.1f} | {r.failures} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rounds], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
