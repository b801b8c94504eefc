"""Request validation for the OpenAI-compatible API: a JSON body in, a typed request or an `ApiError` out.

Unknown fields are ignored (clients send many optional ones); the fields we read are checked for type and range.
The sampling fields use the settings schema of `chatapp.settings`, so a request is held to the same ranges as
config.toml and the command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.events import Message
from engine.sampling import N_TOP, SamplingSettings

from ..settings import ConfigError, _coerce, _sampling_rules
from .tools import ToolRequest, parse_calls, parse_tools

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = N_TOP  # the engine reports this many alternatives per token

# SamplingSettings field -> the request fields that set it; the first one given wins.
_SAMPLING_FIELDS: dict[str, tuple[str, ...]] = {
    "temperature": ("temperature",),
    "top_k": ("top_k",),
    "top_p": ("top_p",),
    "min_p": ("min_p",),
    "repeat_penalty": ("repeat_penalty",),
    "repeat_last_n": ("repeat_last_n",),
    "presence_penalty": ("presence_penalty",),
    "frequency_penalty": ("frequency_penalty",),
    "seed": ("seed",),
    "max_tokens": ("max_completion_tokens", "max_tokens", "n_predict"),  # OpenAI's newer name first
}


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Generation:
    """What both endpoints ask of the engine, besides the prompt."""

    model: str | None  # the requested model id; None = the one served
    settings: SamplingSettings
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage
    n_logprobs: int | None  # None: no logprobs; else how many alternatives per token (0..MAX_TOP_LOGPROBS)
    ignore_eos: bool  # llama-server's: the end-of-turn token does not end the reply


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]
    gen: Generation
    tools: ToolRequest = ToolRequest()


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]  # text, or token ids
    gen: Generation


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """body[name] if present and not null, checked against `kind` (a bool is never an int); else None."""
    value = body.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        raise _bad(name, f"expected {what}, got {_type_name(value)}")
    return value


def _int_in(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = _field(body, name, int, "an integer")
    if value is not None and not lo <= value <= hi:
        raise _bad(name, f"expected an integer from {lo} to {hi}, got {value}")
    return value


def _sampling(body: Mapping[str, Any], defaults: SamplingSettings) -> SamplingSettings:
    rules = _sampling_rules()
    values: dict[str, Any] = {}
    for name, aliases in _SAMPLING_FIELDS.items():
        for alias in reversed(aliases):  # each given one is checked; the first alias wins
            value = body.get(alias)
            if value is None:
                continue
            try:
                values[name] = _coerce(value, rules[name], alias, from_cli=False)
            except ConfigError as e:
                raise ApiError(400, str(e), param=alias) from None
    return dataclasses.replace(defaults, **values)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop", f"expected a string or an array of strings, got {_type_name(value)}")
    if len(items) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    return tuple(s for s in items if s)


def _generation(body: Mapping[str, Any], defaults: SamplingSettings, n_logprobs: int | None) -> Generation:
    model = _field(body, "model", str, "a string")
    n = _int_in(body, "n", 1, 1 << 31)
    if n is not None and n != 1:
        raise _bad("n", f"only n=1 is supported, got {n}")
    stream = bool(_field(body, "stream", bool, "a boolean"))
    options = _field(body, "stream_options", dict, "an object") or {}
    include_usage = bool(_field(options, "include_usage", bool, "a boolean"))
    ignore_eos = bool(_field(body, "ignore_eos", bool, "a boolean"))
    return Generation(model, _sampling(body, defaults), _stop(body), stream, include_usage, n_logprobs, ignore_eos)


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or an array of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise _bad(f"{where}[{i}]", f"only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(where, f"expected a string or an array of text parts, got {_type_name(value)}")


def parse_chat(body: Mapping[str, Any], defaults: SamplingSettings) -> ChatRequest:
    """A /v1/chat/completions body; raises ApiError (400) naming the first bad field."""
    raw = body.get("messages")
    if raw is None:
        raise _bad("messages", "is required")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", f"expected a non-empty array, got {_type_name(raw) if raw != [] else 'an empty one'}")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected an object, got {_type_name(m)}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"{where}.role", f"expected one of {', '.join(map(repr, ROLES))}, got {role!r}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        text = _content(content, f"{where}.content")
        calls = parse_calls(m["tool_calls"], f"{where}.tool_calls") if m.get("tool_calls") else ()
        if calls and role != "assistant":
            raise _bad(f"{where}.tool_calls", "only an assistant message carries tool calls")
        call_id = m.get("tool_call_id") or ""
        name = m.get("name") or ""
        if not isinstance(call_id, str) or not isinstance(name, str):
            raise _bad(f"{where}.tool_call_id", "expected a string")
        reasoning = m.get("reasoning_content")
        reasoning = reasoning if isinstance(reasoning, str) else ""
        messages.append(Message(ROLES[role], text, calls, call_id, name, reasoning))
    n_logprobs = None
    if _field(body, "logprobs", bool, "a boolean"):
        n_logprobs = _int_in(body, "top_logprobs", 0, 20) or 0
        if n_logprobs > MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", f"this server reports at most {MAX_TOP_LOGPROBS}, got {n_logprobs}")
    elif body.get("top_logprobs") is not None:
        raise _bad("top_logprobs", "needs logprobs: true")
    return ChatRequest(tuple(messages), _generation(body, defaults, n_logprobs), parse_tools(body))


def parse_completion(body: Mapping[str, Any], defaults: SamplingSettings) -> CompletionRequest:
    """A /v1/completions body; raises ApiError (400) naming the first bad field."""
    raw = body.get("prompt")
    if raw is None:
        raise _bad("prompt", "is required")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]  # a batch of one
    prompt: str | tuple[int, ...]
    if isinstance(raw, str):
        prompt = raw
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        prompt = tuple(raw)
    else:
        raise _bad("prompt", "expected a string or a non-empty array of token ids (one prompt per request)")
    if _field(body, "echo", bool, "a boolean"):
        raise _bad("echo", "echoing the prompt is not supported")
    best_of = _int_in(body, "best_of", 1, 1 << 31)
    if best_of is not None and best_of != 1:
        raise _bad("best_of", f"only best_of=1 is supported, got {best_of}")
    n_logprobs = _int_in(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    return CompletionRequest(prompt, _generation(body, defaults, n_logprobs))


def check_token_ids(ids: Sequence[int], n_vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary (0 to {n_vocab - 1})")
