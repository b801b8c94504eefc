"""Edge paths of `chatapp serve` on the real SmolLM2: empty prompts and messages, a lone surrogate, a completion
prompt longer than the context, and more conversations than slots.

One server for the module, with two slots and a 256-token context, so that a few hundred words overflow it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.test_serve import Server, _start

N_CTX = 256
N_SLOTS = 2


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(tmp_path_factory.mktemp("serve-paths"), smollm2_path, "-np", str(N_SLOTS), "-c", str(N_CTX))


def _post(server: Server, path: str, body: dict) -> tuple[int, dict]:
    r = server.http("POST", path, json={"model": server.model, **body})
    return r.status_code, r.json()


def test_empty_completion_prompt_is_a_400_naming_it(server: Server) -> None:
    status, body = _post(server, "/v1/completions", {"prompt": "", "max_tokens": 4})
    # SmolLM2 adds no BOS, so "" is no tokens at all: nothing to continue.
    assert status == 400, body
    assert body["error"]["param"] == "prompt"


def test_empty_message_list_is_a_400_naming_it(server: Server) -> None:
    status, body = _post(server, "/v1/chat/completions", {"messages": [], "max_tokens": 4})
    assert status == 400, body
    assert body["error"]["param"] == "messages"
    assert "empty" in body["error"]["message"]


def test_empty_content_is_answered(server: Server) -> None:
    """An empty user message still renders a prompt (the template's turn markers): a defined, ordinary answer."""
    status, body = _post(
        server, "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "max_tokens": 4}
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > 0
    assert 1 <= body["usage"]["completion_tokens"] <= 4
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_lone_surrogate_is_not_a_500(server: Server, path: str) -> None:
    # Valid JSON (an escape), but no UTF-8 text: the string cannot be encoded for the tokenizer.
    if path == "/v1/chat/completions":
        raw = b'{"messages":[{"role":"user","content":"a\\ud800b"}],"max_tokens":4}'
    else:
        raw = b'{"prompt":"a\\ud800b","max_tokens":4}'
    before = server.output()
    r = server.http("POST", path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert r.json()["error"]["message"], r.text
    assert "Traceback" not in server.output()[len(before):]


def test_completion_prompt_longer_than_the_context(server: Server) -> None:
    # 400 words pass the size bound (2000 bytes is at least 25 tokens) and are then counted exactly: over 256.
    status, body = _post(server, "/v1/completions", {"prompt": "apple " * 400, "max_tokens": 4})
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    assert f"the context holds {N_CTX}" in error["message"]
    n_tokens = int(error["message"].split("the prompt is ")[1].split(" tokens")[0])
    assert N_CTX < n_tokens <= 401, error["message"]


def _chat(server: Server, messages: list[dict]) -> dict:
    status, body = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "seed": 1})
    assert status == 200, body
    return body


def test_more_conversations_than_slots(server: Server) -> None:
    """Three conversations on two slots. A request takes the slot whose cache it continues (more than half of that
    cache is its prefix), else the least recently used: after turns A, B, C the slots hold C and B, so the next
    turns C and B reuse their whole first prompt and A, evicted, reuses at most the few tokens the chats share."""
    topics = ["the ocean and its tides", "mountain railways in winter", "baking sourdough bread at home"]
    # A distinct system message each, so that no two caches share more than the template's first tokens.
    convs = [
        [{"role": "system", "content": f"You talk only about {t}."}, {"role": "user", "content": f"Tell me of {t}."}]
        for t in topics
    ]
    first = []
    for conv in convs:
        body = _chat(server, conv)
        conv.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        conv.append({"role": "user", "content": "Say more."})
        first.append(body["usage"]["prompt_tokens"])
    cached = {}
    for i in (2, 1, 0):  # C and B are still in a slot; A was evicted by C
        body = _chat(server, convs[i])
        cached[i] = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert body["usage"]["prompt_tokens"] > first[i]
    assert cached[2] >= first[2], (cached, first)
    assert cached[1] >= first[1], (cached, first)
    assert cached[0] < first[0] // 2, (cached, first)
