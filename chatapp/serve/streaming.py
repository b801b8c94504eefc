"""Delivering a job's events to its HTTP client: Server-Sent Events, or one body, and cancelling the job as
soon as the client goes away (a disconnect is noticed while waiting, not only when the next write fails)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.types import Receive, Scope, Send

from engine.events import TurnStats

from .scheduler import Job, Token

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies must not hold the tokens back
]


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(receive: Receive, job: Job) -> None:
    """Wait for the client to disconnect (the body has been read, so nothing else arrives), then cancel."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


@contextlib.asynccontextmanager
async def cancelled_on_disconnect(receive: Receive, job: Job) -> AsyncIterator[None]:
    """While inside, a client disconnect cancels `job`; leaving (for any reason) cancels it too."""
    watcher = asyncio.create_task(_cancel_on_disconnect(receive, job))
    try:
        yield
    finally:
        watcher.cancel()
        job.cancel()  # a no-op once the job has finished


async def collect(job: Job, receive: Receive) -> tuple[list[Token], TurnStats]:
    """All of a job's tokens and its stats, for a non-streamed answer."""
    tokens: list[Token] = []
    async with cancelled_on_disconnect(receive, job):
        async for item in job.stream():
            if isinstance(item, TurnStats):
                return tokens, item
            tokens.append(item)
    raise AssertionError("a job's stream ends with its TurnStats")


class EventStream:
    """An ASGI response that sends `chunks` (SSE text) as they come, for `job`."""

    def __init__(self, job: Job, chunks: AsyncGenerator[str, None]) -> None:
        self.job = job
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with cancelled_on_disconnect(receive, self.job):
            try:
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client went away mid-write
                pass
            finally:
                await self.chunks.aclose()
