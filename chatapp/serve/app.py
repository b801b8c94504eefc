"""The routes of the OpenAI-compatible API (and llama-server's /health and /slots) on Starlette.

Every error is an OpenAI-shaped JSON answer: bad requests 4xx, a busy or loading server 503, and anything
unexpected 500 without a traceback.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import sys
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.constraint import compile_grammar
from engine.errors import GrammarError
from engine.events import TurnStats
from engine.sampling import SamplingSettings
from engine.tool_calls import CallFormat, parse_reply
from engine.tool_calls.reasoning import ReasoningStream, split_reasoning
from engine.tool_calls.stream import CallStream, Delta

from . import formats
from . import tools as tool_shapes
from .lengths import fewest_tokens, longest_token_bytes
from .prompts import Prompter
from .scheduler import Job, Scheduler
from .schema import ApiError, Generation, check_logit_bias, parse_chat, parse_completion
from .streaming import EventStream, collect, sse

MAX_BODY_BYTES = 4 << 20  # far more than any prompt that fits a context; a bigger body is refused (413)
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


@dataclass
class Service:
    """What the routes need: the scheduler, the model's names and the default sampling settings."""

    scheduler: Scheduler
    model_id: str  # what /v1/models lists
    model_names: frozenset[str]  # what a request's `model` may say (the id, the file's name and stem, ...)
    defaults: SamplingSettings  # config.toml and the command line; a request overrides per field
    api_key: str | None = None
    max_body: int = MAX_BODY_BYTES
    created: int = field(default_factory=lambda: int(time.time()))
    _prompter: Prompter | None = None
    _longest_token: int = 0  # bytes; see lengths.py

    def prompter(self) -> Prompter:
        """The prompt builder, once the model is loaded; ApiError 503 before."""
        if self._prompter is None:
            s = self.scheduler
            if s.state != "ready" or s.model is None or s.pool is None:
                message = "Loading model" if s.state == "loading" else "the model is not available"
                raise ApiError(503, message, type="unavailable_error", code=s.state)
            self._longest_token = longest_token_bytes(s.model.tokenizer)
            self._prompter = Prompter(s.model, s.pool.slots[0].chat.template)
        return self._prompter

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ApiError(
                404,
                f"model {name!r} is not served here; this server has {self.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def check_fits(self, prompt: list[int], param: str) -> None:
        self._check_length(len(prompt), f"{len(prompt)} tokens", param)

    def check_bytes(self, texts: list[str], param: str) -> None:
        """Refuse, before tokenizing them, texts too long for the context whatever their tokens (lengths.py)."""
        self.prompter()  # sets _longest_token
        n_tokens, n_bytes = fewest_tokens(texts, self._longest_token)
        self._check_length(n_tokens, f"at least {n_tokens} tokens ({n_bytes} bytes)", param)

    def _check_length(self, n_tokens: int, said: str, param: str) -> None:
        n_ctx = self.scheduler.model.n_ctx if self.scheduler.model else 0
        if n_tokens >= n_ctx:
            raise ApiError(
                400,
                f"the prompt is {said} and the context holds {n_ctx}, with at least one left for the reply",
                param=param,
                code="context_length_exceeded",
            )


def _service(request: Request) -> Service:
    return request.app.state.service


def _not_finite(text: str) -> float:
    raise ValueError(f"{text} is not a JSON number")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `limit` bytes (read no further), 400 for anything but an object."""
    too_big = ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise too_big

    def parse_float(text: str) -> float:
        value = float(text)
        return value if math.isfinite(value) else _not_finite(text)

    try:
        body = json.loads(bytes(data), parse_constant=_not_finite, parse_float=parse_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _reply_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _check_generation(service: Service, gen: Generation) -> None:
    """400 for a bad grammar or logit_bias, before the request queues (compiling also warms the cache)."""
    model = service.scheduler.model
    if model is None:
        return
    check_logit_bias(gen, model.tokenizer.n_vocab)
    if gen.constraint is not None:
        try:
            await run_in_threadpool(compile_grammar, model.tokenizer, gen.constraint)
        except GrammarError as e:
            raise ApiError(400, f"{gen.constraint_param}: {e}", param=gen.constraint_param) from None


def _submit(service: Service, prompt: list[int], gen: Generation, request_id: str, param: str) -> Job:
    service.check_fits(prompt, param)
    job = Job(prompt, gen, request_id)
    service.scheduler.submit(job)
    return job


# -- routes -------------------------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    state = _service(request).scheduler.state
    if state == "ready":
        return JSONResponse({"status": "ok"})
    message = "Loading model" if state == "loading" else "the model is not available"
    return _error_response(ApiError(503, message, type="unavailable_error", code=state))


async def models(request: Request) -> Response:
    service = _service(request)
    model = service.scheduler.model
    meta = {"n_ctx": model.n_ctx, "n_vocab": model.n_vocab} if model is not None else None
    entry = {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "chatapp"}
    return JSONResponse({"object": "list", "data": [{**entry, "meta": meta}]})


async def slots(request: Request) -> Response:
    return JSONResponse(_service(request).scheduler.slots_info())


async def chat_completions(request: Request) -> Response | EventStream:
    service = _service(request)
    prompter = service.prompter()
    req = parse_chat(await read_json(request, service.max_body), service.defaults)
    service.check_model(req.gen.model)
    tr = req.tools
    fmt = prompter.call_format
    prefix = ""  # the reply's forced start, written into the prompt (none: the calls' grammar forces it)
    gen = req.gen
    if tr.active:
        if gen.constraint is not None:
            param = gen.constraint_param
            raise ApiError(400, f"{param}: cannot be combined with tools", param=param)
        gen = dataclasses.replace(gen, constraint=tr.constraint(fmt), constraint_param="tools")
    await _check_generation(service, gen)
    tools = tr.tools if tr.active else None
    service.check_bytes([m.content for m in req.messages], "messages")  # before the template sees megabytes
    # templating and tokenizing: off the loop
    prompt = await run_in_threadpool(prompter.chat, req.messages, tools, tr.template_kwargs, prefix)
    thinking = await run_in_threadpool(prompter.opens_thinking, tr.template_kwargs)
    rid = _reply_id("chatcmpl")
    head = {"id": rid, "created": int(time.time()), "model": service.model_id}
    job = _submit(service, prompt, gen, rid, "messages")
    if gen.stream:
        return EventStream(job, _chat_chunks(job, gen, head, ReplyShape(tr, fmt, prefix, thinking)))
    tokens, stats = await collect(job, request.receive)
    n_top = req.gen.n_logprobs
    logprobs = {"content": [formats.chat_logprob(t, n_top) for t in tokens]} if n_top is not None else None
    reasoning, answer = split_reasoning(stats.reply, thinking)
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if reasoning:
        message["reasoning_content"] = reasoning
    finish = formats.finish_reason(stats)
    if tr.active:
        parsed = parse_reply(prefix + answer, fmt)
        calls = tool_shapes.kept(parsed.calls, tr)
        if calls:
            message["content"] = parsed.content or None
            message["tool_calls"] = [tool_shapes.call_json(c) for c in calls]
            finish = "tool_calls" if finish == "stop" else finish
        elif prefix:  # a forced call that did not parse: the client sees all the model wrote
            message["content"] = prefix + answer
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return JSONResponse(_final(head, "chat.completion", choice, stats))


@dataclass(frozen=True)
class ReplyShape:
    """How a chat reply is split while it streams: its call format, forced opening and thinking block."""

    tools: tool_shapes.ToolRequest
    fmt: CallFormat
    prefix: str
    thinking: bool


async def _chat_chunks(job: Job, gen: Generation, head: dict[str, Any], shape: ReplyShape) -> AsyncGenerator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "object": "chat.completion.chunk", "choices": [choice]})

    held = formats.HeldText(gen.stop)
    think = ReasoningStream(shape.thinking)
    calls = CallStream(shape.fmt, shape.prefix) if shape.tools.active else None
    n_calls = 0

    def deltas(text: str) -> list[dict[str, Any]]:
        nonlocal n_calls
        reasoning, answer = think.push(text)
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if calls is None:
            return out + ([{"content": answer}] if answer else [])
        for d in calls.push(answer):
            out.extend(_call_delta(d, shape.tools))
        n_calls = len(calls.ids)
        return out

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for item in job.stream():
            if isinstance(item, TurnStats):
                for d in deltas(held.finish(item.reply)):
                    yield chunk(d)
                finish = formats.finish_reason(item)
                if calls is not None:
                    owed, parsed = calls.finish(shape.prefix + split_reasoning(item.reply, shape.thinking)[1])
                    for call in owed:
                        for part in _call_delta(call, shape.tools):
                            yield chunk(part)
                    if tool_shapes.kept(parsed.calls, shape.tools) and finish == "stop":
                        finish = "tool_calls"
                yield chunk({}, finish)
                if gen.include_usage:
                    final = {**head, "object": "chat.completion.chunk", "choices": []}
                    yield sse({**final, "usage": formats.usage(item), "timings": formats.timings(item)})
                break
            text = held.push(item.event.text)
            n_top = gen.n_logprobs
            logprobs = {"content": [formats.chat_logprob(item, n_top)]} if n_top is not None else None
            parts = deltas(text)
            if logprobs and not parts:
                parts = [{"content": ""}]
            for i, d in enumerate(parts):
                yield chunk(d, logprobs=logprobs if i == 0 else None)
    except ApiError as e:
        yield sse(e.body())
    yield "data: [DONE]\n\n"


def _call_delta(d: Delta, tools: tool_shapes.ToolRequest) -> list[dict[str, Any]]:
    if d.index < 0:
        return [{"content": d.content}] if d.content else []
    if d.index > 0 and not tools.parallel:
        return []
    return [{"tool_calls": [tool_shapes.delta_json(d)]}]


async def completions(request: Request) -> Response | EventStream:
    service = _service(request)
    prompter = service.prompter()
    req = parse_completion(await read_json(request, service.max_body), service.defaults)
    service.check_model(req.gen.model)
    await _check_generation(service, req.gen)
    if isinstance(req.prompt, str):
        service.check_bytes([req.prompt], "prompt")
    else:
        service.check_fits(list(req.prompt), "prompt")
    prompt = await run_in_threadpool(prompter.text, req.prompt)
    rid = _reply_id("cmpl")
    head = {"id": rid, "created": int(time.time()), "model": service.model_id}
    job = _submit(service, prompt, req.gen, rid, "prompt")
    start = len(req.prompt) if isinstance(req.prompt, str) else 0
    if req.gen.stream:
        return EventStream(job, _completion_chunks(job, req.gen, head, start))
    tokens, stats = await collect(job, request.receive)
    n_top = req.gen.n_logprobs
    choice = {
        "index": 0,
        "text": stats.reply,
        "logprobs": formats.completion_logprobs(tokens, n_top, start) if n_top is not None else None,
        "finish_reason": formats.finish_reason(stats),
    }
    return JSONResponse(_final(head, "text_completion", choice, stats))


async def _completion_chunks(job: Job, gen: Generation, head: dict[str, Any], start: int) -> AsyncGenerator[str]:
    def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> str:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "object": "text_completion", "choices": [choice]})

    held = formats.HeldText(gen.stop)
    at = start
    try:
        async for item in job.stream():
            if isinstance(item, TurnStats):
                yield chunk(held.finish(item.reply), formats.finish_reason(item))
                if gen.include_usage:
                    final = {**head, "object": "text_completion", "choices": []}
                    yield sse({**final, "usage": formats.usage(item), "timings": formats.timings(item)})
                break
            text = held.push(item.event.text)
            n_top = gen.n_logprobs
            logprobs = formats.completion_logprobs([item], n_top, at) if n_top is not None else None
            at += len(item.event.text)
            if text or logprobs:
                yield chunk(text, logprobs=logprobs)
    except ApiError as e:
        yield sse(e.body())
    yield "data: [DONE]\n\n"


def _final(head: dict[str, Any], kind: str, choice: dict[str, Any], stats: TurnStats) -> dict[str, Any]:
    return {
        **head,
        "object": kind,
        "choices": [choice],
        "usage": formats.usage(stats),
        "timings": formats.timings(stats),
    }


# -- errors and auth ----------------------------------------------------------------------------------------


def _error_response(error: ApiError) -> Response:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    error = ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)), code=None)
    error.headers = dict(exc.headers or {})
    return _error_response(error)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    print(f"chatapp: error: {request.method} {request.url.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return _error_response(ApiError(500, "internal server error", type="server_error", code="internal_error"))


class BearerAuth:
    """Every path but /health needs `Authorization: Bearer KEY`; otherwise 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8"), self.key):
                error = ApiError(
                    401, "invalid or missing API key", type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )  # fmt: skip
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(service: Service) -> ASGIApp:
    """The ASGI application for `service`."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/slots", slots, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error, Exception: _on_unexpected},
    )
    app.state.service = service
    return BearerAuth(app, service.api_key) if service.api_key else app
