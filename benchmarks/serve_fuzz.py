"""A long fuzz of a real `chatapp serve`: thousands of Hypothesis-generated bad requests, with figures to record.

    python benchmarks/serve_fuzz.py [--requests 3000] [--model PATH] [--ctx 1024] [--slots 4]

Starts the server on 127.0.0.1 (a free port), then: a warm-up, the greedy owl question and its RSS, the fuzz
(tests/reliability/fuzz_requests.py's strategies with a fresh seed), forty 3.9 MB prompts, and the cache-order
sequence (the owl question, an unrelated chat, the owl question again). Prints a Markdown report: status counts,
failures (any 5xx, unfinished stream, traceback), RSS at each step, whether the greedy replies matched.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.reliability.fuzz_requests import OWLS, Call, check_answer, greedy_reply, requests, rss_mb  # noqa: E402

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _start(model: str, ctx: int, slots: int, log: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "chatapp", "serve", "-m", model, "--port", "0", "-c", str(ctx), "-np", str(slots)]
    process = subprocess.Popen(args, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"chatapp serve exited:\n{log.read_text()}")
        if url is None:
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
            url = found.group(1) if found else None
        else:
            try:
                if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                    return process, url
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    raise SystemExit("the server did not start within 600 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--model", default=str(Path.home() / ".cache/chatapp/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--slots", type=int, default=4, help="-np; the issue's cache-order sequence used 1")
    args = p.parse_args()

    log = Path(tempfile.mkdtemp()) / "server.log"
    process, url = _start(args.model, args.ctx, args.slots, log)
    rss: dict[str, float] = {}
    try:
        post = lambda path, body: httpx.post(f"{url}{path}", json=body, timeout=300)  # noqa: E731
        post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        post("/v1/completions", {"prompt": "x " * 2000, "max_tokens": 1})
        before = greedy_reply(url, OWLS)
        rss["after warm-up"] = rss_mb(process.pid)

        statuses: collections.Counter[int] = collections.Counter()
        failures: list[str] = []
        t0 = time.perf_counter()

        @settings(
            max_examples=max(args.requests, 1), deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(requests)
        def one(call: Call) -> None:
            try:
                response = call.send(url, 300)
            except httpx.HTTPError as e:
                failures.append(f"{type(e).__name__} for {call.method} {call.path} {call.body[:200]!r}")
                return
            statuses[response.status_code] += 1
            try:
                check_answer(call, response)
            except (AssertionError, ValueError, KeyError) as e:
                failures.append(str(e)[:500])

        if args.requests:
            one()
        fuzz_s = time.perf_counter() - t0
        rss["after the fuzz"] = rss_mb(process.pid)
        health = httpx.get(f"{url}/health", timeout=30).status_code
        after_fuzz = greedy_reply(url, OWLS)

        text = "owls hoot " * 390_000
        t0 = time.perf_counter()
        codes = collections.Counter()
        for i in range(40):
            body = {"messages": [{"role": "user", "content": text}]} if i % 2 else {"prompt": text}
            answer = post("/v1/chat/completions" if i % 2 else "/v1/completions", body)
            codes[(answer.status_code, answer.json().get("error", {}).get("code"))] += 1
        huge_s = time.perf_counter() - t0
        rss["after forty 3.9 MB prompts"] = rss_mb(process.pid)

        first = greedy_reply(url, OWLS)
        greedy_reply(url, "Write two sentences about the sea.")
        again = greedy_reply(url, OWLS)
    finally:
        process.terminate()
        process.wait(timeout=30)
    server_log = log.read_text(errors="replace")
    tracebacks = server_log.count("Traceback") + server_log.count("chatapp: error:")

    n = sum(statuses.values())
    served = f"{Path(args.model).name}, -c {args.ctx}, -np {args.slots}"
    print(f"# Server fuzz: {n} requests to `chatapp serve` ({served})\n")
    print(f"CPU: {_cpu()}, {os.cpu_count()} threads (shared with other work). {time.strftime('%Y-%m-%d')}\n")
    print(f"- fuzz: {n} requests in {fuzz_s:.0f} s ({n / max(fuzz_s, 1e-9):.1f}/s)")
    print(f"- statuses: {dict(sorted(statuses.items()))}")
    print(f"- failures (5xx, reset, unfinished stream, bad error shape): {len(failures)}")
    for f in failures[:20]:
        print(f"  - {f}")
    print(f"- tracebacks or `chatapp: error:` lines in the server log: {tracebacks}")
    print(f"- /health after the fuzz: {health}")
    print(f"- the greedy owl reply after the fuzz equals the one before: {after_fuzz == before}")
    print(f"- forty 3.9 MB prompts: {dict(codes)} in {huge_s:.1f} s")
    print("- server RSS: " + ", ".join(f"{k} {v:.0f} MB" for k, v in rss.items()))
    print(f"- cache-order sequence (owls, an unrelated chat, owls) gives equal replies: {first == again}")
    if first != again:
        print(f"  - first: {first!r}\n  - again: {again!r}")


if __name__ == "__main__":
    main()
