"""Hypothesis strategies for requests a client should never send to `chatapp serve`, and the checks on each answer.

Shared by tests/reliability/test_serve_fuzz.py (a short run in CI) and benchmarks/serve_fuzz.py (a long one).
Every generated request asks for at most `MAX_REPLY` tokens, or for more only where it must be refused, so a run's
length depends on the number of requests, not on what the model says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

try:
    import httpx2 as httpx  # what this openai release is built on
except ImportError:  # pragma: no cover - older openai releases use httpx
    import httpx

MAX_REPLY = 2  # tokens a fuzzed request may generate
# 307: Starlette's redirect of a trailing slash. Anything else (500, 503, a reset connection) is a failure.
OK_STATUSES = {200, 307, 400, 404, 405, 413}
N_VOCAB_SMOLLM2 = 49152
OWLS = "Say hello, and tell me one fact about owls."

SAMPLING_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
    "frequency_penalty", "seed",
)  # fmt: skip
LENGTH_FIELDS = ("max_tokens", "n_predict")  # max_completion_tokens, which wins over both, stays tiny
OTHER_FIELDS = (
    "model", "messages", "prompt", "stream", "stream_options", "stop", "logprobs", "top_logprobs", "n",
    "ignore_eos", "echo", "best_of", "user", "tools", "response_format",
)  # fmt: skip

# Values at the edges of float32, float64 and the declared ranges (engine/sampling.py SAMPLER_SETTINGS).
EXTREME_NUMBERS = (
    -1e308, 1e308, 5e-324, -5e-324, 0.0, -0.0, 1e-45, 1e-46, 3.5e38, -3.5e38, 1000.0, -1000.0, 1000.0001,
    -1000.0001, 100.0, 100.00001, 0.001, 0.000999, 1.0, 1.5, -1, -2, 0, 1, 2**31, 2**63, 2**64, -(2**64), 10**12,
    10**100,
)  # fmt: skip

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(EXTREME_NUMBERS),
    st.text(max_size=20),
)
json_values = st.recursive(
    _leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)  # fmt: skip
# Any code point, lone surrogates included (json.dumps sends them as "\ud800" escapes).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
roles = st.one_of(
    st.sampled_from(["user", "system", "assistant", "developer", "tool", "function", "", "USER", "model"]), json_values
)


@st.composite
def chat_messages(draw: st.DrawFn) -> object:
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)  # not an array of messages at all
    messages = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 9)) == 0:
            messages.append(draw(json_values))
            continue
        message: dict[str, object] = {"role": draw(roles) if draw(st.booleans()) else "user"}
        content = draw(
            st.one_of(
                any_text,
                st.just(""),
                json_values,
                st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]), "text": any_text})),
            )
        )
        if draw(st.integers(0, 19)):
            message["content"] = content
        messages.append(message)
    return messages


@st.composite
def completion_prompts(draw: st.DrawFn) -> object:
    n = N_VOCAB_SMOLLM2
    ids = st.one_of(st.integers(0, n - 1), st.sampled_from([-1, n, n + 1, 2**31, 2**63, 2**64, -(2**64)]))
    return draw(
        st.one_of(
            any_text,
            st.just(""),
            st.lists(ids, max_size=8),
            st.lists(st.lists(ids, max_size=3), max_size=3),
            st.lists(any_text, max_size=3),
            json_values,
        )
    )


@dataclass(frozen=True)
class Call:
    """One request: method, path, headers and raw body bytes."""

    method: str
    path: str
    body: bytes
    content_type: str = "application/json"

    def send(self, url: str, timeout: float) -> httpx.Response:
        headers = {"content-type": self.content_type}
        return httpx.request(self.method, f"{url}{self.path}", content=self.body, headers=headers, timeout=timeout)


def _dumps(body: object) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as escapes


@st.composite
def field_confusions(draw: st.DrawFn) -> Call:
    """A valid request with fields replaced by values of any type or size."""
    chat = draw(st.booleans())
    body: dict[str, object] = {"max_completion_tokens": draw(st.integers(1, MAX_REPLY)), "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(any_text) or "hi"}]
    else:
        body["prompt"] = draw(any_text) or "hi"
    names = SAMPLING_FIELDS + LENGTH_FIELDS + OTHER_FIELDS
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=4)):
        if name == "messages":
            body[name] = draw(chat_messages())
        elif name == "prompt":
            body[name] = draw(completion_prompts())
        else:
            body[name] = draw(st.one_of(json_values, st.sampled_from(EXTREME_NUMBERS)))
    if body.get("stream") is True:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Call("POST", draw(st.sampled_from([path, path.removeprefix("/v1")])), _dumps(body))


def _raw(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


@st.composite
def malformed_bodies(draw: st.DrawFn) -> Call:
    """Bodies that are not JSON, not an object, or JSON that Python reads in ways a client may not expect."""
    valid = '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1'
    kind = draw(st.integers(0, 9))
    if kind == 0:
        body = draw(st.binary(max_size=200))
    elif kind == 1:
        body = _raw(valid[: draw(st.integers(0, len(valid)))])  # truncated
    elif kind == 2:
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000, "01", "+1"]))
        field = draw(st.sampled_from(SAMPLING_FIELDS + ("max_tokens",)))
        body = _raw(f'{valid}, "{field}": {literal}}}')
    elif kind == 3:
        depth = draw(st.sampled_from([100, 1000, 10_000, 100_000]))
        body = _raw(f'{valid}, "stop": {"[" * depth}{"]" * depth}}}')
    elif kind == 4:
        surrogate = draw(st.sampled_from(["\\ud800", "\\udfff", "\\ud83d", "\\ud800\\ud800", "\\u0000"]))
        body = _raw(f'{{"messages": [{{"role": "user", "content": "a{surrogate}b"}}], "max_completion_tokens": 1}}')
    elif kind == 5:
        body = b'{"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}], "max_completion_tokens": 1}'
    elif kind == 6:
        body = _dumps(draw(json_values))  # valid JSON, rarely an object
    elif kind == 7:
        body = _raw(f'{valid}, "temperature": 0, "temperature": "{draw(any_text)}"}}')  # a duplicated key
    elif kind == 8:
        body = _raw(valid + "}" + draw(st.sampled_from(["}", "garbage", "\x00", " ", "[]"])))
    else:
        body = b""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    content_type = draw(st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]))
    return Call("POST", path, body, content_type)


@st.composite
def wrong_routes(draw: st.DrawFn) -> Call:
    path = draw(
        st.one_of(
            st.sampled_from(["/", "/v1", "/v1/chat", "/v1/models/x", "/slots/0", "/health/", "/%00", "/v1/embeddings"]),
            st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#%"), max_size=30).map(
                lambda p: "/" + p
            ),
        )
    )
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    return Call(method, path, b"{}")


requests = st.one_of(field_confusions(), field_confusions(), field_confusions(), malformed_bodies(), wrong_routes())


def check_answer(call: Call, response: httpx.Response) -> None:
    """No 5xx, an OpenAI-shaped error for every refusal, and a whole reply or stream for every success."""
    what = f"{call.method} {call.path} {call.body[:300]!r}"
    assert response.status_code in OK_STATUSES, f"{response.status_code} for {what}: {response.text[:500]}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"unfinished stream for {what}: {response.text[-300:]}"
        for event in events[:-1]:
            assert "error" not in json.loads(event), f"an error mid-stream for {what}: {event}"
        return
    if response.status_code == 307:
        return
    answer = response.json()
    if response.status_code == 200:
        assert "error" not in answer, what
    else:
        error = answer["error"]
        assert isinstance(error["message"], str) and error["message"], what


def rss_mb(pid: int) -> float:
    """Resident set size of process `pid` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def greedy_reply(url: str, content: str, timeout: float = 120, flush_slots: int = 0, max_tokens: int = 24) -> str:
    """The greedy reply to one user message. With `flush_slots`, first that many one-token prompts that share no
    prefix with any chat take every slot, so the message is computed in one pass, whatever the cache held (a reply
    on a near tie can depend on how its prompt was split into passes, until prefill is made batch-invariant)."""
    for i in range(flush_slots):
        flush = {"prompt": [5000 + i], "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=flush, timeout=timeout).status_code == 200
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": max_tokens}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]
