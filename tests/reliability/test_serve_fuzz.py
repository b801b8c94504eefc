"""A fuzz of a real `chatapp serve` (SmolLM2, 127.0.0.1 only): malformed, oversized and type-confused requests.

Hypothesis generates the requests (tests/reliability/fuzz_requests.py); a fixed seed (`derandomize`) keeps CI's run
the same every time, and benchmarks/serve_fuzz.py runs thousands more with fresh seeds. After the fuzz the server
must still answer /health, hold about the memory it held before, and give a fixed greedy request the reply it gave
before. Beside the fuzz: the bounds it leans on, said plainly (sampling ranges, max_tokens, prompts too long for
the context) and the memory after forty 3.9 MB prompts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from tests.app.test_serve import Server, _start
from tests.reliability.fuzz_requests import OWLS, Call, check_answer, greedy_reply, requests, rss_mb

try:
    import httpx2 as httpx  # what this openai release is built on
except ImportError:  # pragma: no cover - older openai releases use httpx
    import httpx

N_CTX = 1024  # tests/app/test_serve.py's _start serves this context
# 68 s for 300 on Intel Xeon model 207, 2 threads, shared (256 s when about eight other jobs were running).
FUZZ_EXAMPLES = int(os.environ.get("CHATAPP_FUZZ_EXAMPLES", "300"))
# Growth of the server's RSS over the fuzz, after a warm-up. Measured (Intel Xeon model 207, 2 threads): +2 MB over
# these 300 requests (266 → 268 MB), +20 MB over 3,000 (benchmarks/results/serve-fuzz-xeon-207.md). The issue saw
# +393 MB over one pass before prompts too long were refused from their size.
FUZZ_RSS_GROWTH_MB = 50
# The bound for forty 3.9 MB prompts. Measured (Intel Xeon model 207): 299 → 299 MB here, 269 → 268 MB in the
# benchmark; the issue saw ~1.17 GB when each was tokenized before being refused.
HUGE_PROMPTS_RSS_GROWTH_MB = 50
TIMEOUT_S = 120
N_SLOTS = 4  # chatapp serve's default -np


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module; _start asserts at the end that its log holds no traceback."""
    yield from _start(tmp_path_factory.mktemp("serve-fuzz"), smollm2_path)


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT_S)


def _warm_up(server: Server) -> None:
    """Requests of each kind once, so that the readings after it count what stays, not first-use allocations."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _post(server, "/v1/chat/completions", chat)
    _post(server, "/v1/chat/completions", {**chat, "stream": True, "logprobs": True, "top_logprobs": 5})
    _post(server, "/v1/completions", {"prompt": "x " * 2000, "max_tokens": 1})  # tokenized, then too long


def test_the_fuzz_finds_no_500_and_leaves_the_server_as_it_was(server: Server) -> None:
    _warm_up(server)
    before = greedy_reply(server.url, OWLS, flush_slots=N_SLOTS)
    rss_before = rss_mb(server.process.pid)
    seen: list[int] = []

    @settings(
        max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(requests)
    def one(call: Call) -> None:
        response = call.send(server.url, TIMEOUT_S)
        seen.append(response.status_code)
        check_answer(call, response)

    one()
    assert len(seen) >= FUZZ_EXAMPLES // 2, "Hypothesis ran far fewer requests than asked"
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT_S).json() == {"status": "ok"}
    growth = rss_mb(server.process.pid) - rss_before
    assert growth < FUZZ_RSS_GROWTH_MB, f"RSS grew {growth:.0f} MB over {len(seen)} requests"
    assert greedy_reply(server.url, OWLS, flush_slots=N_SLOTS) == before
    # The cache-order sequence: the owl question, an unrelated chat, the owl question again. Served; the two
    # replies are compared (and may differ on a near tie) in benchmarks/serve_fuzz.py until prefill is batch-invariant.
    for content in (OWLS, "Write two sentences about the sea.", OWLS):
        assert greedy_reply(server.url, content)
    log = server.output()
    assert "Traceback" not in log and "chatapp: error:" not in log, log[-3000:]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", -1e308),  # was a 500: float32 overflow in the sampler
        ("frequency_penalty", 1e308),
        ("repeat_penalty", 5e-324),  # was a 500: rounds to 0 in float32
        ("repeat_penalty", 1e308),
        ("temperature", 1e308),
        ("temperature", -0.5),
        ("top_p", 1.0000001),
        ("min_p", -1e-300),
        ("presence_penalty", 1000.5),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_sampling_values_outside_the_declared_range_are_a_400_naming_the_field(
    server: Server, path: str, field: str, value: float
) -> None:
    body = {"max_tokens": 1, field: value}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: expected a number between")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_ends_of_each_declared_range_are_served(server: Server, path: str) -> None:
    """The declared extremes all at once reach the sampler and come back as a reply (not a 500)."""
    from engine.sampling import SAMPLER_SETTINGS_BY_NAME as S

    for end in ("low", "high"):
        body = {name: getattr(S[name], end) for name in ("repeat_penalty", "presence_penalty", "frequency_penalty")}
        body |= {"temperature": S["temperature"].high, "repeat_last_n": -1, "max_tokens": 3, "ignore_eos": True}
        body |= {"messages": [{"role": "user", "content": "hi hi hi"}]} if "chat" in path else {"prompt": "hi hi"}
        response = _post(server, path, body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("max_tokens", [-1, 10**12, 2**64])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n_predict"])
def test_max_tokens_past_the_context_is_clamped_and_ends_with_length(
    server: Server, field: str, max_tokens: int
) -> None:
    """-1 (llama-server's "unlimited") and any larger-than-the-context count: the reply runs until the context is
    full and says `length` (docs/serve.md). The prompt leaves 3 places, so the run is short. The reply's last
    token needs no place in the cache, so prompt and reply come to one more than the context."""
    prompt = [1] * (N_CTX - 3)  # token ids, so its length is exact
    response = _post(server, "/v1/completions", {"prompt": prompt, field: max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == N_CTX + 1


@pytest.mark.parametrize("max_tokens", [0, -2, -(2**64), 1.5, "8"])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n_predict"])
def test_max_tokens_below_one_other_than_minus_one_is_a_400(server: Server, field: str, max_tokens: object) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], field: max_tokens}
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize("n_bytes", [20_000, 3_000_000])  # tokenized and then refused; refused from its bytes
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_prompt_longer_than_the_context_is_a_400_giving_both_lengths(server: Server, path: str, n_bytes: int) -> None:
    text = "owls hoot " * (n_bytes // 10)
    body = {"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text}
    response = _post(server, path, {**body, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    said = error["message"]
    assert f"the context holds {N_CTX}" in said and " tokens" in said, said
    n_tokens = int(said.split(" tokens")[0].split()[-1])
    assert n_tokens >= N_CTX, said  # the prompt's length (or the fewest tokens it can be), then the context's


def test_memory_after_forty_huge_prompts_returns(server: Server) -> None:
    """Forty 3.9 MB prompts (just under the 4 MB body limit), alternately chat and completions: refused from
    their byte count, so none is tokenized, and the server's memory comes back to where it was."""
    _warm_up(server)
    text = "owls hoot " * 390_000
    rss_before = rss_mb(server.process.pid)
    for i in range(40):
        body = {"messages": [{"role": "user", "content": text}]} if i % 2 else {"prompt": text}
        response = _post(server, "/v1/chat/completions" if i % 2 else "/v1/completions", body)
        assert response.json()["error"]["code"] == "context_length_exceeded"
    growth = rss_mb(server.process.pid) - rss_before
    assert abs(growth) < HUGE_PROMPTS_RSS_GROWTH_MB, f"RSS moved {growth:+.0f} MB over forty 3.9 MB prompts"
    assert greedy_reply(server.url, "Name a colour.")  # and it still serves


@pytest.fixture(scope="module")
def one_slot(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One slot, so the unrelated chat replaces the owl question's cache; --deterministic prefill."""
    yield from _start(tmp_path_factory.mktemp("serve-one-slot"), smollm2_path, "-np", "1", "--deterministic")


def test_the_cache_order_sequence_gives_the_same_greedy_reply(one_slot: Server) -> None:
    """The issue's sequence: the owl question at temperature 0, an unrelated chat, the owl question again; the
    second prompt is computed partly from the cache, in a shorter pass. The issue saw the replies differ without
    --deterministic; on today's code this sequence happened to match without it too (checked here, 96 tokens),
    so the proof that the split cannot matter is tests/engine/test_determinism.py's bit-for-bit logits."""
    first = greedy_reply(one_slot.url, OWLS, max_tokens=96)
    assert greedy_reply(one_slot.url, "Write two sentences about the sea.", max_tokens=8)
    assert greedy_reply(one_slot.url, OWLS, max_tokens=96) == first
