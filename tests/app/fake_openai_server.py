"""A scripted OpenAI-compatible server on 127.0.0.1 (Starlette on uvicorn, in a thread) for the remote backend's
failure modes: each request takes the next mode from `FakeServer.modes` ("ok" when empty).

Modes: ok, forever (tokens until the client leaves), hang (headers never come), 401, 404, 429, 503,
bad-json, bad-shape, no-finish, not-sse, no-logprobs-400 (refuses logprobs, then ok), timings (llama-server's
`timings`, no `usage`), call-add (a streamed call of `add` with a=20, b=22, its arguments in pieces). Nothing
here waits on the machine's speed: `forever` streams until the client closes, `hang` until the client gives up.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

REPLY = ["Hello", ",", " world", "!"]
LOGPROBS = [-0.01, -0.5, -1.2, -0.1]
MODELS = ["fake-a", "fake-b"]


@dataclass
class FakeServer:
    url: str = ""  # http://127.0.0.1:PORT/v1
    modes: list[str] = field(default_factory=list)
    api_key: str | None = None
    owned_by: str = "llamacpp"
    bodies: list[dict[str, Any]] = field(default_factory=list)  # every generation request's JSON body
    arrived: threading.Event = field(default_factory=threading.Event)  # a generation request came in
    disconnected: threading.Event = field(default_factory=threading.Event)  # a client left a stream
    sent: int = 0  # chunks sent by the current `forever` stream

    def mode(self) -> str:
        return self.modes.pop(0) if self.modes else "ok"


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "error", "param": None, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def _sse(obj: Any) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _chunk(text: str | None, logprob: float | None = None, finish: str | None = None, **extra: Any) -> dict:
    delta = {"content": text} if text is not None else {}
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    if logprob is not None:
        top = [{"token": text, "logprob": logprob}, {"token": " other", "logprob": logprob - 2.0}]
        choice["logprobs"] = {"content": [{"token": text, "logprob": logprob, "top_logprobs": top}]}
    return {"id": "c1", "object": "chat.completion.chunk", "model": "fake-a", "choices": [choice], **extra}


def build_app(fake: FakeServer) -> Starlette:
    def authorised(request: Request) -> bool:
        return fake.api_key is None or request.headers.get("authorization") == f"Bearer {fake.api_key}"

    async def models(request: Request) -> Response:
        if not authorised(request):
            return _error(401, "Invalid API Key")
        data = [{"id": m, "object": "model", "owned_by": fake.owned_by, "meta": {"n_ctx": 4096}} for m in MODELS]
        return JSONResponse({"object": "list", "data": data})

    async def chat(request: Request) -> Response:
        body = await request.json()
        fake.bodies.append(body)
        fake.arrived.set()
        if not authorised(request):
            return _error(401, "Invalid API Key")
        mode = fake.mode()
        if body.get("model") not in MODELS:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        if mode in ("401", "404"):
            return _error(int(mode), "Invalid API Key" if mode == "401" else "The model `x` does not exist.")
        if mode == "429":
            return _error(429, "too many requests", {"Retry-After": "7"})
        if mode == "503":
            return _error(503, "Loading model", {"Retry-After": "3"})
        if mode == "not-sse":
            return Response("<html>proxy login</html>", media_type="text/html")
        if mode == "no-logprobs-400":
            if body.get("logprobs"):
                fake.modes.insert(0, "ok")
                return _error(400, "logprobs is not supported")
            mode = "ok"
        with_logprobs = bool(body.get("logprobs"))

        async def events() -> AsyncIterator[str]:
            try:
                if mode == "hang":
                    while True:
                        await asyncio.sleep(3600)
                yield _sse({**_chunk(None), "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                if mode == "forever":
                    while True:
                        fake.sent += 1
                        yield _sse(_chunk(" x", -0.2 if with_logprobs else None))
                        await asyncio.sleep(0.005)
                if mode == "bad-json":
                    yield _sse(_chunk("Hel"))
                    yield "data: {not json\n\n"
                    return
                if mode == "call-add":
                    head = {"index": 0, "id": "call_7", "type": "function", "function": {"name": "add"}}
                    yield _sse({**_chunk(None), "choices": [{"index": 0, "delta": {"tool_calls": [head]}}]})
                    for part in ('{"a": ', "20, ", '"b": 22}'):
                        piece = {"index": 0, "function": {"arguments": part}}
                        yield _sse({**_chunk(None), "choices": [{"index": 0, "delta": {"tool_calls": [piece]}}]})
                    yield _sse(_chunk(None, finish="tool_calls"))
                    yield _sse("[DONE]")
                    return
                if mode == "bad-shape":
                    yield _sse(_chunk("Hel"))
                    yield _sse({"choices": [{"delta": {"content": 5}}]})
                    return
                for text, lp in zip(REPLY, LOGPROBS, strict=True):
                    yield _sse(_chunk(text, lp if with_logprobs else None))
                if mode == "no-finish":
                    return
                if mode == "timings":
                    timings = {"cache_n": 5, "prompt_n": 7, "prompt_ms": 12.5, "predicted_n": 4}
                    yield _sse(_chunk(None, finish="stop", timings=timings))
                else:
                    yield _sse(_chunk(None, finish="stop"))
                    usage = {
                        "prompt_tokens": 20,
                        "completion_tokens": 4,
                        "total_tokens": 24,
                        "prompt_tokens_details": {"cached_tokens": 12},
                    }
                    yield _sse({"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": usage})
                yield _sse("[DONE]")
            finally:
                fake.disconnected.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        body = await request.json()
        fake.bodies.append(body)

        async def events() -> AsyncIterator[str]:
            for text in REPLY:
                yield _sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
            yield _sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


@contextmanager
def fake_server(**kwargs: Any) -> Iterator[FakeServer]:
    """The fake on a free port of 127.0.0.1 until the block ends."""
    fake = FakeServer(**kwargs)
    config = uvicorn.Config(build_app(fake), host="127.0.0.1", port=0, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the fake server did not start")
        threading.Event().wait(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    fake.url = f"http://127.0.0.1:{port}/v1"
    try:
        yield fake
    finally:
        server.should_exit = True
        thread.join(timeout=10)
