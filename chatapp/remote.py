"""A `ChatBackend` on an OpenAI-compatible server (vLLM, SGLang, llama-server, Ollama, `chatapp serve`), through
the official `openai` client.

The server's answers are untrusted: every chunk is read as plain JSON and checked field by field, and anything
wrong (a refused connection, 401, an unknown model, 429/503, a timeout, a malformed stream) ends as one
`RemoteError` line naming the server. Nothing is kept between calls but the client, so regenerate and edit are
just another request; the server's own prompt cache makes them cheap, and `usage` says how cheap.

Timing is measured here, on the client: TTFT from the request to the first text, and each token's arrival.
Sampling settings travel with each request, so a change made mid-reply applies from the next reply.
"""

from __future__ import annotations

import json
import math
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import openai

from engine.errors import EngineError
from engine.events import (
    STOP_CANCELLED,
    STOP_EOS,
    STOP_LENGTH,
    Alternative,
    GrammarSpec,
    Message,
    TokenEvent,
    ToolCall,
    ToolSpec,
    TurnStats,
)
from engine.sampling import SamplingSettings

N_TOP = 5  # top_logprobs asked for: OpenAI's API allows up to 20, llama-server and vLLM honour 5 and more
NO_KEY = "sk-no-key-required"  # the client insists on a key; servers without --api-key ignore it
UNKNOWN_PROB = -1.0  # TokenEvent.prob when the server sent no logprobs


class RemoteError(EngineError):
    """The server could not be used or answered something unusable; the message is one line naming it."""


# ---- what each server honours -----------------------------------------------------------------------------

STANDARD = frozenset({"temperature", "top_p", "seed", "max_tokens", "presence_penalty", "frequency_penalty"})
EXTRA = frozenset({"top_k", "min_p", "repeat_penalty"})  # sent in the body as the llama.cpp / vLLM extensions


@dataclass(frozen=True)
class ServerKind:
    name: str  # shown in the status line and the sampling panel
    honoured: frozenset[str]  # SamplingSettings fields it is documented to honour
    ignored: frozenset[str] = frozenset()  # fields it is documented to ignore (not sent)
    repeat_field: str = "repeat_penalty"  # vLLM and SGLang call it repetition_penalty
    # Where a chat's JSON schema goes: OpenAI's response_format {"type": "json_schema"}, or llama-cpp-python's
    # own {"type": "json_object", "schema": ...} (it answers 500 to the first); "" for a raw completion that
    # has no schema field on this server (llama-cpp-python drops an unknown `json_schema` without a word).
    chat_schema: str = "json_schema"
    completion_schema: bool = True
    calls_under_auto: bool = True  # whether it reads tool calls out of a reply under tool_choice auto


LLAMA_CPP = ServerKind("llama.cpp", STANDARD | EXTRA | {"repeat_last_n"})
# llama-cpp-python 0.3.36, measured in tests/app/test_remote_llama_cpp_tools.py.
LLAMA_CPP_PYTHON = ServerKind(
    "llama-cpp-python", STANDARD | EXTRA, chat_schema="json_object", completion_schema=False, calls_under_auto=False
)
KINDS: dict[str, ServerKind] = {  # by the `owned_by` of /v1/models
    "llamacpp": LLAMA_CPP,  # llama-server
    "me": LLAMA_CPP_PYTHON,
    "chatapp": ServerKind("chatapp serve", STANDARD | EXTRA | {"repeat_last_n"}),
    "vllm": ServerKind("vLLM", STANDARD | EXTRA, repeat_field="repetition_penalty"),
    "sglang": ServerKind("SGLang", STANDARD | EXTRA, repeat_field="repetition_penalty"),
    # Ollama's /v1 takes only OpenAI's own fields; its top_k etc. live in its native API's `options`.
    "library": ServerKind("Ollama", STANDARD, ignored=EXTRA),
    "ollama": ServerKind("Ollama", STANDARD, ignored=EXTRA),
}
UNKNOWN_KIND = ServerKind("an OpenAI-compatible server", STANDARD)


@dataclass(frozen=True)
class RemoteInfo:
    """Where the replies come from, for the status line and the sampling panel."""

    base_url: str
    host: str  # host[:port]
    server: str  # "llama.cpp", "vLLM", ... or "an OpenAI-compatible server"
    honoured: frozenset[str]  # settings the server is known to honour
    ignored: frozenset[str]  # settings it is known to ignore; any other is sent and may or may not be honoured


def constraint_fields(spec: GrammarSpec | None, chat: bool, kind: ServerKind | None = None) -> dict[str, Any]:
    """The body fields that ask a server (of `kind`, default: one that speaks OpenAI's API) for a reply
    matching `spec`.

    A chat sends OpenAI's `response_format` (vLLM, SGLang, llama-server, chatapp serve; llama-cpp-python takes
    the schema inside a `json_object` format); a completion sends llama-server's `json_schema` (OpenAI's
    /completions has no response_format). A GBNF or Lark grammar goes as llama-server's `grammar`. A regex has no
    field a server shares, and a server known to drop a field is not sent it: RemoteError."""
    kind = kind or UNKNOWN_KIND
    if spec is None:
        return {}
    if spec.trigger is not None:
        raise RemoteError("a lazy grammar cannot be sent to a server")
    if not chat and spec.kind in ("json_object", "json_schema") and not kind.completion_schema:
        raise RemoteError(f"{kind.name}'s server has no JSON schema field for a raw completion; add --chat")
    if spec.kind == "json_object":
        return {"response_format": {"type": "json_object"}} if chat else {"json_schema": {"type": "object"}}
    if spec.kind == "json_schema":
        schema = json.loads(spec.source)
        if chat and kind.chat_schema == "json_object":
            return {"response_format": {"type": "json_object", "schema": schema}}
        if chat:
            return {"response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema,
                                                                                "strict": True}}}  # fmt: skip
        return {"json_schema": schema}
    if spec.kind in ("gbnf", "lark"):
        return {"grammar": spec.source}
    raise RemoteError(f"a {spec.kind} constraint has no request field that servers share; use a JSON schema")


def request_fields(settings: SamplingSettings, kind: ServerKind) -> dict[str, Any]:
    """The sampling part of a request body: OpenAI's fields, and llama.cpp/vLLM's extensions where they mean
    something. Disabled settings are left out, so the server's own default (also "off") applies."""
    body: dict[str, Any] = {
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "presence_penalty": settings.presence_penalty,
        "frequency_penalty": settings.frequency_penalty,
    }
    if settings.seed >= 0:
        body["seed"] = settings.seed
    if settings.max_tokens > 0:
        body["max_tokens"] = settings.max_tokens
    if "top_k" not in kind.ignored:
        body["top_k"] = settings.top_k
        body["min_p"] = settings.min_p
        fields = ("repeat_penalty", "repetition_penalty") if kind is UNKNOWN_KIND else (kind.repeat_field,)
        for name in fields:
            body[name] = settings.repeat_penalty
    # llama.cpp's penalty window; -1 (the whole context) only where the server takes it (llama-server).
    if "repeat_last_n" in kind.honoured and (settings.repeat_last_n >= 0 or kind is LLAMA_CPP):
        body["repeat_last_n"] = settings.repeat_last_n
    return body


# ---- errors fit for one line ------------------------------------------------------------------------------


def _clean(text: object, limit: int = 200) -> str:
    """A server's text made safe for one line: no control characters, collapsed spaces, bounded length."""
    flat = re.sub(r"[\x00-\x1f\x7f]+", " ", str(text))
    flat = re.sub(r"\s+", " ", flat).strip()
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _server_message(body: object) -> str:
    if isinstance(body, Mapping):
        error = body.get("error", body)
        if isinstance(error, Mapping) and error.get("message"):
            return _clean(error["message"])
        if isinstance(error, str):
            return _clean(error)
        if body.get("detail"):  # FastAPI's shape (llama-cpp-python)
            return _clean(body["detail"])
    return _clean(body) if body else ""


def _retry_after(exc: openai.APIStatusError) -> str:
    value = exc.response.headers.get("retry-after", "") if exc.response is not None else ""
    return f", retry after {_clean(value, 20)} s" if re.fullmatch(r"\d{1,6}", value.strip()) else ""


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc


def describe_failure(exc: BaseException, where: str, *, timeout: float, model: str | None = None) -> str:
    """One line for a failed request to `where` ("the server at HOST")."""
    if isinstance(exc, openai.APITimeoutError):
        return f"{where} sent nothing for {timeout:g} s (timeout); send again to retry"
    if isinstance(exc, openai.APIConnectionError):
        cause = _root_cause(exc)
        text = str(cause).lower()
        if isinstance(cause, ConnectionRefusedError) or "refused" in text:
            reason = "connection refused (is the server running?)"
        elif "name or service not known" in text or "nodename nor servname" in text or "getaddrinfo" in text:
            reason = "the host name is not known"
        elif isinstance(cause, TimeoutError) or "timed out" in text:
            return f"{where} sent nothing for {timeout:g} s (timeout); send again to retry"
        else:
            reason = _clean(cause) or type(cause).__name__
        return f"cannot reach {where}: {reason}"
    if isinstance(exc, openai.APIStatusError):
        status, message = exc.status_code, _server_message(exc.body)
        said = f": {message}" if message else ""
        if status == 401:
            fix = "set --api-key, OPENAI_API_KEY or [remote] api_key"
            return f"{where} refused the API key (401 Unauthorized{said}); {fix}"
        if status == 403:
            return f"{where} refused access (403 Forbidden{said})"
        if status == 404 and model is not None and "model" in message.lower():
            return f"{where} has no model {model!r} (404{said})"
        if status == 404:
            return f"{where} answered 404 Not Found{said}; is the URL the API's base (usually ending in /v1)?"
        if status == 429:
            return f"{where} is busy (429 Too Many Requests{_retry_after(exc)}){said}; send again to retry"
        if status == 503:
            return f"{where} is unavailable (503 Service Unavailable{_retry_after(exc)}){said}; send again to retry"
        return f"{where} answered {status}{said}"
    if isinstance(exc, json.JSONDecodeError):
        return f"{where} sent a malformed stream: an event is not JSON ({_clean(exc.doc, 60)!r})"
    if isinstance(exc, openai.APIError):  # an error event inside the stream
        return f"{where} reported an error mid-stream: {_clean(exc.message)}"
    return f"{where}: {type(exc).__name__}: {_clean(exc)}"


# ---- reading the untrusted stream -------------------------------------------------------------------------


class Malformed(Exception):
    """A chunk that is not what the API says it is; the message names the field."""


def _get(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str, required: bool = False) -> Any:
    value = obj.get(key)
    if value is None:
        if required:
            raise Malformed(f"{path}.{key} is missing")
        return None
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise Malformed(f"{path}.{key} is {_clean(repr(value), 40)}, expected {getattr(kind, '__name__', kind)}")
    return value


def _number(obj: Mapping[str, Any] | None, key: str, path: str) -> float | None:
    if obj is None:
        return None
    value = _get(obj, key, (int, float), path)
    if value is not None and (not math.isfinite(value) or value < 0):
        raise Malformed(f"{path}.{key} is {value!r}, expected a count or a duration")
    return value


def _prob(logprob: object, path: str) -> float:
    # A little above 0 is rounding (servers send float32 values); more is not a log-probability.
    if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or math.isnan(logprob) or logprob > 1e-3:
        raise Malformed(f"{path} is {_clean(repr(logprob), 40)}, expected a log-probability")
    return min(1.0, math.exp(max(logprob, -1e4)))


@dataclass
class Piece:
    """The text of one streamed event, with what the server said about its tokens."""

    text: str
    tokens: list[tuple[str, float, tuple[Alternative, ...]]]  # (token text, prob, top alternatives); may be []


def _chat_logprobs(choice: Mapping[str, Any], path: str) -> list[tuple[str, float, tuple[Alternative, ...]]]:
    logprobs = _get(choice, "logprobs", dict, path)
    entries = _get(logprobs, "content", list, f"{path}.logprobs") if logprobs else None
    out = []
    for i, entry in enumerate(entries or []):
        where = f"{path}.logprobs.content[{i}]"
        if not isinstance(entry, dict):
            raise Malformed(f"{where} is not an object")
        token = _get(entry, "token", str, where, required=True)
        top = []
        for j, alt in enumerate(_get(entry, "top_logprobs", list, where) or []):
            if not isinstance(alt, dict):
                raise Malformed(f"{where}.top_logprobs[{j}] is not an object")
            text = _get(alt, "token", str, f"{where}.top_logprobs[{j}]", required=True)
            top.append(Alternative(-1, text, _prob(alt.get("logprob"), f"{where}.top_logprobs[{j}].logprob")))
        out.append((token, _prob(entry.get("logprob"), f"{where}.logprob"), tuple(top[:N_TOP])))
    return out


def _completion_logprobs(choice: Mapping[str, Any], path: str) -> list[tuple[str, float, tuple[Alternative, ...]]]:
    logprobs = _get(choice, "logprobs", dict, path)
    if not logprobs:
        return []
    where = f"{path}.logprobs"
    tokens = _get(logprobs, "tokens", list, where) or []
    values = _get(logprobs, "token_logprobs", list, where) or []
    tops = _get(logprobs, "top_logprobs", list, where) or []
    out = []
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise Malformed(f"{where}.tokens[{i}] is not text")
        prob = _prob(values[i], f"{where}.token_logprobs[{i}]") if i < len(values) else UNKNOWN_PROB
        top_map = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        top = [Alternative(-1, str(t), _prob(lp, f"{where}.top_logprobs[{i}]")) for t, lp in top_map.items()]
        top.sort(key=lambda a: -a.prob)
        out.append((token, prob, tuple(top[:N_TOP])))
    return out


@dataclass
class ChunkInfo:
    piece: Piece | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    timings: dict[str, Any] | None
    reasoning: str = ""  # delta.reasoning_content (llama-server, vLLM, DeepSeek) or delta.reasoning
    calls: list[tuple[int, str, str, str]] = field(default_factory=list)  # (index, id, name, arguments) pieces


def _call_deltas(delta: Mapping[str, Any], where: str) -> list[tuple[int, str, str, str]]:
    """delta.tool_calls as (index, id, name, arguments) pieces; the id and name come once, arguments in parts."""
    out = []
    for i, c in enumerate(_get(delta, "tool_calls", list, where) or []):
        at = f"{where}.tool_calls[{i}]"
        if not isinstance(c, dict):
            raise Malformed(f"{at} is not an object")
        index = _get(c, "index", int, at)
        fn = _get(c, "function", dict, at) or {}
        out.append(
            (
                i if index is None else index,
                _get(c, "id", str, at) or "",
                _get(fn, "name", str, f"{at}.function") or "",
                _get(fn, "arguments", str, f"{at}.function") or "",
            )
        )
    return out


def parse_chunk(chunk: object, chat: bool, n: int) -> ChunkInfo:
    """One streamed event of /chat/completions (`chat`) or /completions; `n` numbers it in errors."""
    path = f"event {n}"
    if not isinstance(chunk, dict):
        raise Malformed(f"{path} is {type(chunk).__name__}, expected an object")
    choices = _get(chunk, "choices", list, path) or []
    usage = _get(chunk, "usage", dict, path)
    timings = _get(chunk, "timings", dict, path)
    piece, finish, reasoning, calls = None, None, "", []
    if choices:
        choice = choices[0]
        where = f"{path}.choices[0]"
        if not isinstance(choice, dict):
            raise Malformed(f"{where} is not an object")
        finish = _get(choice, "finish_reason", str, where)
        if chat:
            delta = _get(choice, "delta", dict, where) or {}
            text = _get(delta, "content", str, f"{where}.delta")
            reasoning = _get(delta, "reasoning_content", str, f"{where}.delta") or ""
            reasoning = reasoning or _get(delta, "reasoning", str, f"{where}.delta") or ""
            calls = _call_deltas(delta, f"{where}.delta")
            tokens = _chat_logprobs(choice, where)
        else:
            text = _get(choice, "text", str, where)
            tokens = _completion_logprobs(choice, where)
        if text:
            piece = Piece(text, tokens)
    return ChunkInfo(piece, finish, usage, timings, reasoning, calls)


def split_piece(piece: Piece) -> list[tuple[str, float, tuple[Alternative, ...]]]:
    """The events to show for one piece: one per token when the logprobs spell the text exactly, else one."""
    if piece.tokens and "".join(t for t, _, _ in piece.tokens) == piece.text:
        return piece.tokens
    if len(piece.tokens) == 1:
        _, prob, top = piece.tokens[0]
        return [(piece.text, prob, top)]
    return [(piece.text, UNKNOWN_PROB, ())]


# ---- the backend ------------------------------------------------------------------------------------------


def wire_message(m: Message) -> dict[str, Any]:
    """A message in OpenAI's request shape, with its calls or the call it answers."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        # OpenAI's API takes no content beside calls; llama-cpp-python refuses a null one (500), so leave it out.
        if not m.content:
            del out["content"]
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name and m.role == "tool":
        out["name"] = m.name
    return out


def host_of(base_url: str) -> str:
    parts = urlsplit(base_url)
    return parts.netloc.rsplit("@", 1)[-1] or base_url  # never show credentials put in the URL


class RemoteBackend:
    """`ChatBackend` on one model of an OpenAI-compatible server. Build it with `connect`."""

    def __init__(
        self,
        client: openai.OpenAI,
        model_id: str,
        info: RemoteInfo,
        kind: ServerKind,
        settings: SamplingSettings,
        *,
        n_ctx: int = 0,
        timeout: float = 120.0,
        logprobs: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.client = client
        self.model_id = model_id
        self.remote = info
        self.kind = kind
        self.model_name = f"{model_id} @ {info.host}"
        self.n_ctx = n_ctx  # 0 when the server does not say
        self.settings = settings
        self.timeout = timeout
        self.logprobs = logprobs
        self.clock = clock
        self.extra: dict[str, Any] = {}
        """More body fields for every request (e.g. `logit_bias`), as the `openai` client's extra_body."""
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._stream: openai.Stream[object] | None = None
        self._warnings: list[str] = []
        self._told_auto = False  # the warning that tool calls under auto stay text, said once

    @property
    def where(self) -> str:
        return f"the server at {self.remote.host}"

    def warnings(self) -> list[str]:
        return list(self._warnings)

    def cancel(self) -> None:
        """Stop the reply now, from any thread: the connection is shut down, so the server sees the client
        leave and the reader, blocked or not, ends with the tokens it has."""
        self._cancel.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            _shut_down(stream)

    def stream_reply(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None = None,
        *,
        constraint: GrammarSpec | None = None,
    ) -> Iterator[TokenEvent | TurnStats]:
        body: dict[str, Any] = {"messages": [wire_message(m) for m in messages]}
        if tools:
            body["tools"] = [dict(t) for t in tools]
            if not self.kind.calls_under_auto and "tool_choice" not in self.extra and not self._told_auto:
                self._told_auto = True
                self._warnings.append(
                    f"{self.kind.name}'s server returns tool calls only when tool_choice names a tool; a call the "
                    "model writes under auto stays text and does not run"
                )
        fields = constraint_fields(constraint, chat=True, kind=self.kind)
        return self._generate("/chat/completions", {**body, **fields}, chat=True)

    def stream_completion(
        self, prompt: str, extra: Mapping[str, Any] | None = None, *, constraint: GrammarSpec | None = None
    ) -> Iterator[TokenEvent | TurnStats]:
        """A raw continuation of `prompt` (`/completions`): `chatapp run` without --chat. `extra`: more body
        fields (`chatapp bench` sends llama-server's ignore_eos)."""
        body = {"prompt": prompt, **constraint_fields(constraint, chat=False, kind=self.kind), **(extra or {})}
        return self._generate("/completions", body, chat=False)

    def _body(self, body: dict[str, Any], chat: bool, logprobs: bool) -> dict[str, Any]:
        out = {"model": self.model_id, **body, **request_fields(self.settings, self.kind), **self.extra}
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
        if logprobs:
            if chat:
                out.update(logprobs=True, top_logprobs=N_TOP)
            else:
                out["logprobs"] = N_TOP
        return out

    def _open(self, path: str, body: dict[str, Any], chat: bool) -> openai.Stream[object]:
        try:
            return self._post(path, self._body(body, chat, self.logprobs))
        except openai.BadRequestError as exc:
            # A server that refuses logprobs still chats: ask again without them, and from now on.
            if not self.logprobs or "logprob" not in _server_message(exc.body).lower():
                raise
        self.logprobs = False
        self._warnings.append(f"{self.where} refused logprobs; replies will have no token probabilities")
        return self._post(path, self._body(body, chat, False))

    def _post(self, path: str, body: dict[str, Any]) -> openai.Stream[object]:
        stream = self.client.post(path, cast_to=object, body=body, stream=True, stream_cls=openai.Stream[object])
        kind = stream.response.headers.get("content-type", "")
        if "text/event-stream" not in kind:
            stream.close()
            raise RemoteError(f"{self.where} did not stream (content-type {_clean(kind, 60) or 'none'!r})")
        return stream

    def _open_cancellable(self, path: str, body: dict[str, Any], chat: bool) -> openai.Stream[object] | None:
        """`_open` in a thread of its own, so that a cancel while the server has not answered yet (a long
        prompt, a queue) returns at once: None. A stream that opens after that is closed unread."""
        result: queue.Queue[tuple[bool, Any]] = queue.Queue()
        abandoned = threading.Event()

        def opener() -> None:
            try:
                stream = self._open(path, body, chat)
            except BaseException as exc:  # handed to the waiting thread
                result.put((False, exc))
                return
            result.put((True, stream))
            if abandoned.is_set():
                _shut_down(stream)

        threading.Thread(target=opener, name="remote-open", daemon=True).start()
        while True:
            try:
                ok, value = result.get(timeout=0.05)
                break
            except queue.Empty:
                if self._cancel.is_set():
                    abandoned.set()
                    if not result.empty():  # it opened just now: close it here
                        ok, value = result.get()
                        if ok:
                            _shut_down(value)
                    return None
        if not ok:
            raise value
        return value

    def _generate(self, path: str, body: dict[str, Any], chat: bool) -> Iterator[TokenEvent | TurnStats]:
        self._cancel.clear()
        start = self.clock()
        try:
            stream = self._open_cancellable(path, body, chat)
        except RemoteError:
            raise
        except Exception as exc:
            raise RemoteError(describe_failure(exc, self.where, timeout=self.timeout, model=self.model_id)) from None
        if stream is None:  # cancelled before the server answered
            yield self._stats(start, [], "", None, None, None, cancelled=True)
            return
        with self._lock:
            self._stream = stream
        if self._cancel.is_set():  # cancelled as it opened
            _shut_down(stream)
        tokens: list[TokenEvent] = []
        text, finish, usage, timings, last = "", None, None, None, start
        reasoning = ""
        calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
        try:
            for n, chunk in enumerate(stream):
                if self._cancel.is_set():
                    break
                info = parse_chunk(chunk, chat, n)
                usage = info.usage or usage
                timings = info.timings or timings
                finish = info.finish_reason or finish
                for index, call_id, name, args in info.calls:
                    call = calls.setdefault(index, ["", "", ""])
                    call[0], call[1] = call[0] or call_id, call[1] or name
                    call[2] += args
                if info.reasoning:  # shown the way a local model's thinking is, kept apart in the stats
                    now = self.clock()
                    shown = ("<think>" if not reasoning else "") + info.reasoning
                    reasoning += info.reasoning
                    event = TokenEvent(-1, shown, (now - last) * 1000.0, 0.0, UNKNOWN_PROB, (), len(tokens))
                    last = now
                    tokens.append(event)
                    yield event
                if info.piece is None:
                    continue
                if reasoning and not text:
                    closing = TokenEvent(-1, "</think>\n\n", 0.0, 0.0, UNKNOWN_PROB, (), len(tokens))
                    tokens.append(closing)
                    yield closing
                for piece, prob, top in split_piece(info.piece):
                    now = self.clock()
                    event = TokenEvent(-1, piece, (now - last) * 1000.0, 0.0, prob, top, len(tokens))
                    last = now
                    tokens.append(event)
                    text += piece
                    yield event
        except Malformed as exc:
            if not self._cancel.is_set():
                raise RemoteError(f"{self.where} sent a malformed stream: {exc}") from None
        except Exception as exc:
            if not self._cancel.is_set():
                raise RemoteError(describe_failure(exc, self.where, timeout=self.timeout)) from None
        finally:
            with self._lock:
                self._stream = None
            stream.close()
        cancelled = self._cancel.is_set()
        if finish is None and not cancelled:
            raise RemoteError(f"{self.where} sent a malformed stream: it ended before the reply finished")
        stats = self._stats(start, tokens, text, finish, usage, timings, cancelled=cancelled)
        found = tuple(ToolCall(c[0] or f"call_{i}", c[1], c[2]) for i, c in sorted(calls.items()) if c[1])
        yield replace(stats, tool_calls=found, reasoning=reasoning)

    def _stats(
        self,
        start: float,
        tokens: list[TokenEvent],
        text: str,
        finish: str | None,
        usage: dict[str, Any] | None,
        timings: dict[str, Any] | None,
        *,
        cancelled: bool,
    ) -> TurnStats:
        """The turn's numbers: the server's counts where it gave them (`usage`, llama-server's `timings`), our
        own clock for TTFT and decode time."""
        ttft = tokens[0].forward_ms if tokens else (self.clock() - start) * 1000.0
        decode = sum(t.forward_ms for t in tokens[1:])
        try:
            details = _get(usage, "prompt_tokens_details", dict, "usage") if usage else None
            prompt = _number(usage, "prompt_tokens", "usage")
            cached = _number(details, "cached_tokens", "usage.prompt_tokens_details")
            completion = _number(usage, "completion_tokens", "usage")
            cache_n = _number(timings, "cache_n", "timings")
            prompt_n = _number(timings, "prompt_n", "timings")
            prompt_ms = _number(timings, "prompt_ms", "timings")
        except Malformed as exc:
            self._warnings.append(f"{self.where} sent unusable token counts ({exc}); they are left out")
            prompt = cached = completion = cache_n = prompt_n = prompt_ms = None
        if cached is None:
            cached = cache_n
        if prompt is None and prompt_n is not None:
            prompt = prompt_n + (cache_n or 0)
        prompt_tokens = int(prompt or 0)
        reused = min(int(cached or 0), prompt_tokens)
        generated = int(completion) if completion is not None and not cancelled else len(tokens)
        if cancelled:
            stop = STOP_CANCELLED
        elif finish == "length":
            stop = STOP_LENGTH
        else:
            stop = STOP_EOS
        return TurnStats(
            prompt_tokens=prompt_tokens,
            reused_tokens=reused,
            evaluated_tokens=prompt_tokens - reused,
            prefill_ms=float(prompt_ms) if prompt_ms is not None else ttft,
            ttft_ms=ttft,
            decode_ms=decode,
            generated_tokens=generated,
            stop_reason=stop,
            n_ctx_used=prompt_tokens + generated,
            n_ctx=self.n_ctx,
            reply=text,
            device=f"remote: {self.remote.server} at {self.remote.host}",
        )


def _shut_down(stream: openai.Stream[object]) -> None:
    """End a stream from any thread. Closing the response alone does not wake a thread blocked reading it;
    shutting the socket down does (the reader gets end-of-file or an error, and the server a disconnect)."""
    try:
        network = stream.response.extensions.get("network_stream")
        sock = network.get_extra_info("socket") if network is not None else None
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):
        pass  # already closed
    try:
        stream.response.close()
    except Exception:
        pass  # the reader ends on the shut socket or the flag, whichever it sees first


# ---- connecting -------------------------------------------------------------------------------------------


def make_client(base_url: str, api_key: str, timeout: float) -> openai.OpenAI:
    """The client as the backend uses it: no retries of its own (the user's next send retries), a short
    connect timeout, and `timeout` between bytes."""
    return openai.OpenAI(
        base_url=base_url.rstrip("/"),
        api_key=api_key or NO_KEY,
        max_retries=0,
        timeout=openai.Timeout(timeout, connect=min(timeout, 10.0)),
    )


def _model_ids(listing: object, where: str) -> list[tuple[str, dict[str, Any]]]:
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        raise RemoteError(f"{where} sent a malformed model list (no `data` array)")
    out = []
    for entry in data:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry["id"]:
            out.append((entry["id"], entry))
    return out


def _context_size(entry: dict[str, Any], client: openai.OpenAI, kind: ServerKind) -> int:
    """The served context, where the server tells it: vLLM's max_model_len, chatapp's meta.n_ctx, llama-server's
    /props. 0 when unknown."""
    meta = entry.get("meta")
    if not isinstance(meta, dict):
        meta = {}
    for value in (entry.get("max_model_len"), meta.get("n_ctx")):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if kind is LLAMA_CPP:
        try:
            props = client.get("/props", cast_to=object)  # resolved against the base URL
            settings = props.get("default_generation_settings", {}) if isinstance(props, dict) else {}
            value = settings.get("n_ctx") if isinstance(settings, dict) else None
            if isinstance(value, int) and value > 0:
                return value
        except Exception:
            pass  # an older llama-server: the size stays unknown
    return 0


def connect(
    base_url: str,
    *,
    api_key: str = "",
    model: str = "",
    settings: SamplingSettings | None = None,
    timeout: float = 120.0,
    logprobs: bool = True,
    progress: Callable[[str], None] = lambda line: None,
) -> RemoteBackend:
    """Ask the server for its models and pick `model` (default: the first listed). Raises RemoteError."""
    host = host_of(base_url)
    where = f"the server at {host}"
    progress(f"connecting to {host}…")
    client = make_client(base_url, api_key, timeout)
    try:
        listing = client.get("/models", cast_to=object)
    except Exception as exc:
        raise RemoteError(describe_failure(exc, where, timeout=timeout)) from None
    models = _model_ids(listing, where)
    if not models:
        raise RemoteError(f"{where} lists no models")
    ids = [m for m, _ in models]
    if model and model not in ids:
        shown = ", ".join(ids[:8]) + (", …" if len(ids) > 8 else "")
        raise RemoteError(f"{where} has no model {model!r}; it serves: {shown}")
    model_id = model or ids[0]
    entry = dict(models)[model_id]
    owner = entry.get("owned_by")
    kind = KINDS.get(owner, UNKNOWN_KIND) if isinstance(owner, str) else UNKNOWN_KIND
    if kind is UNKNOWN_KIND and urlsplit(base_url).port == 11434:  # Ollama's port, whoever it says owns the model
        kind = KINDS["ollama"]
    info = RemoteInfo(base_url, host, kind.name, kind.honoured, kind.ignored)
    n_ctx = _context_size(entry, client, kind)
    progress(f"{model_id} on {kind.name} at {host}")
    return RemoteBackend(
        client, model_id, info, kind, settings or SamplingSettings(), n_ctx=n_ctx, timeout=timeout, logprobs=logprobs
    )
