"""`chatapp serve` as a real subprocess on the real SmolLM2, driven by the official `openai` client (and raw HTTP
where the client cannot send what we need: malformed JSON, oversized bodies, no Authorization header).

Two servers per module: the main one, and one with an API key, one slot and a queue of one. Nothing here waits
on the machine's speed: a test that needs a generation in flight asks for one that cannot end on its own
(`ignore_eos` and a long `max_tokens`) and closes it.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.reliability.support import PYTHON, REPO, child_env

try:
    import httpx2 as httpx  # what this openai release is built on
except ImportError:  # pragma: no cover - older openai releases use httpx
    import httpx

N_CTX = 1024
KEY = "test-key-123"
START_TIMEOUT_S = 300  # a first start compiles the kernels (minutes on 2 cores); a cached one takes seconds
CALL_TIMEOUT_S = 120
FOREVER = {"ignore_eos": True}  # with a long max_tokens: a reply that only a cancel or the context ends


@dataclass
class Server:
    url: str
    model: str  # the id it serves
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self, api_key: str = "none", **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=CALL_TIMEOUT_S, **kwargs
        )

    def http(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        return httpx.request(method, f"{self.url}{path}", timeout=CALL_TIMEOUT_S, **kwargs)


def _start(tmp: Path, model: Path, *flags: str, model_id: str | None = None) -> Iterator[Server]:
    log = tmp / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [PYTHON, "-m", "chatapp", "serve", "-m", str(model), "--port", "0", "-c", str(N_CTX), *flags],
            cwd=REPO,
            env=child_env(tmp),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = None
        while True:
            assert process.poll() is None, f"chatapp serve exited with {process.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not ready within {START_TIMEOUT_S} s:\n{log.read_text()}"
            if url is None:
                found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
                url = found.group(1) if found else None
            elif _health(url) == 200:
                break
            time.sleep(0.05)
        yield Server(url, model_id or str(model), process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text()


def _health(url: str) -> int | None:
    """/health's status, or None while the server cannot answer yet (a first start keeps the process busy
    compiling: its event loop may not accept within the request's timeout)."""
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code
    except httpx.TransportError:
        return None


def test_the_socket_listens_before_its_address_is_printed() -> None:
    """A client that connects on reading "listening on" waits in the backlog, never refused (a slow start once
    refused the first requests of a test module: Zen 1, 2 cores, kernels compiling)."""
    from chatapp.serve import bind

    sock = bind("127.0.0.1", 0)
    try:
        socket.create_connection(sock.getsockname(), timeout=5).close()
    finally:
        sock.close()


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(tmp_path_factory.mktemp("serve"), smollm2_path)


@pytest.fixture(scope="module")
def guarded(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """API key, one slot, at most one request waiting."""
    yield from _start(
        tmp_path_factory.mktemp("serve-guarded"), smollm2_path, "--api-key", KEY, "-np", "1", "--queue", "1",
        "-a", "smol", model_id="smol",
    )  # fmt: skip


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "Traceback" not in response.text
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


# -- the API ------------------------------------------------------------------------------------------------


def test_health_and_models(server: Server, smollm2_path: Path) -> None:
    assert server.http("GET", "/health").json() == {"status": "ok"}
    models = server.client().models.list().data
    assert [m.id for m in models] == [str(smollm2_path)]
    assert models[0].meta == {"n_ctx": N_CTX, "n_vocab": 49152}


def test_streamed_chat_reports_usage_and_the_second_turn_pays_only_its_new_tokens(server: Server) -> None:
    client = server.client()
    messages = _user("Write one sentence about lighthouses on rocky coasts and the keepers who lived there.")
    chunks = list(
        client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() and finish in (["stop"], ["length"])
    assert all(c.usage is None for c in chunks[:-1])
    first = chunks[-1].usage
    assert chunks[-1].choices == [] and 1 <= first.completion_tokens <= 12
    assert first.total_tokens == first.prompt_tokens + first.completion_tokens

    # The follow-up turn: the whole first prompt (and most of the reply) is already in this slot's cache.
    messages += [{"role": "assistant", "content": text}, *_user("Now say it in fewer words.")]
    reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=4, temperature=0)
    second = reply.usage
    assert second.prompt_tokens > first.prompt_tokens + first.completion_tokens
    assert second.prompt_tokens_details.cached_tokens >= first.prompt_tokens
    assert second.completion_tokens <= 4 and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content


def test_logprobs_in_chat_and_in_completions(server: Server) -> None:
    client = server.client()
    chat = client.chat.completions.create(
        model=server.model, messages=_user("Name three colours."), max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens >= 1
    for entry in content:
        assert entry.logprob <= 0 and 1 <= len(entry.top_logprobs) <= 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        # Greedy: the token taken is the most likely one.
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == chat.choices[0].message.content

    prompt = "The capital of France is"
    completion = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    choice = completion.choices[0]
    lp = choice.logprobs
    n = completion.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n >= 1
    for top, logprob in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == logprob
    assert lp.text_offset[0] == len(prompt)
    assert "".join(lp.tokens) == choice.text and completion.object == "text_completion"


def test_completions_stream_and_stop_at_a_string_spread_over_tokens(server: Server) -> None:
    client = server.client()
    prompt = "Here is a list of the fruits that grow in warm countries and are sold at the old market: apple, banana,"
    args = {"model": server.model, "prompt": prompt, "temperature": 0, "max_tokens": 16, "extra_body": FOREVER}
    # Cache the prompt, so that both runs below start alike: in this slot (the prompt is more than half of its
    # cache), evaluating only the prompt's last token.
    client.completions.create(**{**args, "max_tokens": 1})
    reference = client.completions.create(**args)
    assert reference.usage.prompt_tokens_details.cached_tokens == reference.usage.prompt_tokens - 1
    text = reference.choices[0].text
    at = len(text) // 2
    stop = text[at : at + 5]
    expected = text[: text.find(stop)]

    chunks = list(client.completions.create(**args, stop=[stop], stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == reference.usage.prompt_tokens - 1
    chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Nothing of the stop string was sent before it was complete.
    sent = ""
    for c in chunks:
        sent += c.choices[0].text
        assert expected.startswith(sent), (sent, stop)


def test_three_concurrent_clients_each_get_their_reply_and_keep_their_slot(server: Server) -> None:
    topics = [
        "Describe in detail how bees make honey, from the flowers in the meadow to the comb inside the hive.",
        "Explain step by step how a steam locomotive turns burning coal into the motion of its heavy wheels.",
        "Tell me about the migration of arctic terns, which fly from pole to pole and back every single year.",
    ]

    def converse(topic: str) -> tuple:
        client = server.client()
        messages = _user(topic)
        first = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=8, seed=7, extra_body=FOREVER
        )
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, *_user("Go on.")]
        second = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=4, seed=7, extra_body=FOREVER
        )
        return first, second

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(converse, topics))
    for first, second in results:
        assert first.usage.completion_tokens == 8 and first.choices[0].finish_reason == "length"
        assert second.usage.completion_tokens == 4
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert len({first.choices[0].message.content for first, _ in results}) == 3


def test_a_dropped_stream_is_cancelled_and_the_next_request_works(server: Server) -> None:
    client = server.client()
    stream = client.chat.completions.create(
        model=server.model, messages=_user("Tell me a very long story about a dragon and a knight."),
        max_tokens=100_000, stream=True, extra_body=FOREVER,
    )  # fmt: skip
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    # A raw prompt shares no prefix with the dropped conversation, so it takes another slot and /slots still
    # shows how the dropped one ended. It waits behind that one: it is answered only once the cancel is done.
    reply = client.completions.create(model=server.model, prompt="Yes or no:", max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")
    slot = next(s for s in server.http("GET", "/slots").json() if s["last_request"] == chunk.id)
    # Without the cancel it would have run until the context was full.
    assert slot["last_stop_reason"] == "cancelled"
    assert 3 <= slot["last_generated_tokens"] < N_CTX - 100


def test_a_client_that_gives_up_on_a_plain_request_cancels_it(server: Server) -> None:
    body = {"messages": _user("Write a very long poem about the sea."), "max_tokens": 100_000, **FOREVER}
    with pytest.raises(httpx.ReadTimeout):  # the client hangs up, whatever the server was doing by then
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(CALL_TIMEOUT_S, read=0.5))
    reply = server.client().completions.create(model=server.model, prompt="Yes or no:", max_tokens=3)
    assert reply.usage.completion_tokens >= 1
    slots = server.http("GET", "/slots").json()
    assert not any(s["is_processing"] for s in slots)
    # Had it not been cancelled, it would have run until the context was full before the request above.
    assert all(s["last_generated_tokens"] < N_CTX - 100 for s in slots), slots


# -- bad input ----------------------------------------------------------------------------------------------

TEXT_PARTS = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]

BAD_CHAT = [
    ({"messages": None}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": TEXT_PARTS}]}, 400, "messages[0].content[0]"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 7}, 400, "top_p"),
    ({"top_k": -5}, 400, "top_k"),
    ({"top_k": 2.5}, 400, "top_k"),
    ({"min_p": 1.5}, 400, "min_p"),
    ({"repeat_penalty": 0}, 400, "repeat_penalty"),
    ({"presence_penalty": "lots"}, 400, "presence_penalty"),
    ({"frequency_penalty": [1]}, 400, "frequency_penalty"),
    ({"seed": -7}, 400, "seed"),
    ({"seed": "x"}, 400, "seed"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ({"logprobs": "yes"}, 400, "logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 9}, 400, "top_logprobs"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"stream": "yes"}, 400, "stream"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, 400, "include_usage"),
    ({"stop": 5}, 400, "stop"),
    ({"stop": ["a"] * 17}, 400, "stop"),
    ({"n": 2}, 400, "n"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"model": 7}, 400, "model"),
]


@pytest.mark.parametrize(("fields", "status", "param"), BAD_CHAT, ids=[str(c[0])[:60] for c in BAD_CHAT])
def test_bad_chat_requests_get_openai_errors(server: Server, fields: dict, status: int, param: str) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        server.client().chat.completions.create(
            model=server.model, messages=_user("hi"), max_tokens=2, extra_body=fields
        )
    assert raised.value.status_code == status
    _assert_error(raised.value.response, status, param)


BAD_COMPLETIONS = [
    ({"prompt": None}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ["one", "two"]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": [1, 10**6]}, 400, "prompt"),
    ({"logprobs": 9}, 400, "logprobs"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"echo": True}, 400, "echo"),
    ({"best_of": 3}, 400, "best_of"),
    ({"top_p": -0.5}, 400, "top_p"),
]


@pytest.mark.parametrize(("fields", "status", "param"), BAD_COMPLETIONS, ids=[str(c[0]) for c in BAD_COMPLETIONS])
def test_bad_completion_requests_get_openai_errors(server: Server, fields: dict, status: int, param: str) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        server.client().completions.create(model=server.model, prompt="Hello", max_tokens=2, extra_body=fields)
    _assert_error(raised.value.response, status, param)


def test_raw_bad_bodies_routes_and_prompts(server: Server) -> None:
    post = "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    for body in (b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"[" * 100_000, b'{"temperature": NaN}'):
        error = _assert_error(server.http("POST", post, content=body, headers=headers), 400)
        assert error["type"] == "invalid_request_error"
    too_big = b'{"messages": "' + b"x" * (4 << 20) + b'"}'
    assert _assert_error(server.http("POST", post, content=too_big, headers=headers), 413)["code"]
    _assert_error(server.http("GET", "/v1/nothing"), 404)
    _assert_error(server.http("GET", post), 405)
    long_prompt = {"messages": _user("word " * (N_CTX + 50)), "max_tokens": 2}
    error = _assert_error(server.http("POST", post, json=long_prompt), 400, "messages")
    assert error["code"] == "context_length_exceeded"
    # After all of that, the server still answers.
    assert server.client().completions.create(model=server.model, prompt="Hi", max_tokens=1).usage.completion_tokens


# -- the guarded server: API key, one slot, a queue of one --------------------------------------------------


def test_api_key_is_required_everywhere_but_health(guarded: Server) -> None:
    assert guarded.http("GET", "/health").status_code == 200
    for path in ("/v1/models", "/slots"):
        assert _assert_error(guarded.http("GET", path), 401)["type"] == "authentication_error"
        wrong = guarded.http("GET", path, headers={"authorization": "Bearer nope"})
        _assert_error(wrong, 401)
    _assert_error(guarded.http("POST", "/v1/chat/completions", json={"messages": _user("hi")}), 401)
    with pytest.raises(openai.AuthenticationError):
        guarded.client("not-the-key").models.list()
    assert [m.id for m in guarded.client(KEY).models.list().data] == ["smol"]


def test_a_full_queue_answers_503_with_retry_after(guarded: Server) -> None:
    client = guarded.client(KEY)
    forever = {"model": "smol", "max_tokens": 100_000, "stream": True, "extra_body": FOREVER}
    running = client.chat.completions.create(messages=_user("Tell me a long story."), **forever)
    for chunk in running:
        if chunk.choices and chunk.choices[0].delta.content:
            break  # generating now: the one slot is busy
    waiting = client.chat.completions.create(messages=_user("Tell me another long story."), **forever)
    try:
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="smol", messages=_user("hi"), max_tokens=2)
        assert raised.value.status_code == 503
        assert raised.value.response.headers["retry-after"] == "1"
        assert _assert_error(raised.value.response, 503)["code"] == "queue_full"
    finally:
        running.close()
        waiting.close()
    # Both cancelled; a client that honours Retry-After gets through (the disconnects may be seen a moment late).
    reply = client.with_options(max_retries=5).chat.completions.create(model="smol", messages=_user("hi"), max_tokens=2)
    assert reply.usage.completion_tokens >= 1


def test_a_model_that_fails_to_load_ends_the_server_with_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 60)
    done = subprocess.run(
        [PYTHON, "-m", "chatapp", "serve", "-m", str(broken), "--port", "0"],
        cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=START_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and str(broken) in errors[0], done.stderr
