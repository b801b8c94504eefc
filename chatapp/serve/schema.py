"""Request validation for the OpenAI-compatible API: a JSON body in, a typed request or an `ApiError` out.

Unknown fields are ignored (clients send many optional ones); the fields we read are checked for type and range.
The sampling fields use the settings schema of `chatapp.settings`, so a request is held to the same ranges as
config.toml and the command line.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.constraint import GrammarSpec
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
    constraint: GrammarSpec | None = None  # response_format, or llama-server's grammar / json_schema
    constraint_param: str = ""  # the request field the constraint came from, for errors that name it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -100 bans


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
    _refuse_unsupported(body)
    constraint, param = _constraint(body)
    return Generation(
        model,
        _sampling(body, defaults),
        _stop(body),
        stream,
        include_usage,
        n_logprobs,
        ignore_eos,
        constraint,
        param,
        _logit_bias(body),
    )


# Fields that change what the reply must be, which this server does not implement: a 400 naming the field, never
# a 200 that ignores it. A field given with its "no effect" value passes (some clients always send it).
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "function calls are not supported"),
    "function_call": (("none", "auto"), "function calls are not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "grammar_lazy": ((False,), "lazy grammars are not supported in requests"),
    "grammar_triggers": (([],), "lazy grammars are not supported in requests"),
    "suffix": (("",), "inserting before a suffix is not supported"),
    "n_probs": ((0,), "use logprobs and top_logprobs"),
    "post_sampling_probs": ((False,), "use logprobs and top_logprobs"),
    "guided_json": ((), "use response_format or json_schema"),
    "guided_regex": ((), "use response_format or grammar"),
    "guided_choice": ((), "use response_format or grammar"),
    "guided_grammar": ((), "use grammar"),
}


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, (harmless, why) in _UNSUPPORTED.items():
        value = body.get(name)
        if value is None or any(value == h and type(value) is type(h) for h in harmless):
            continue
        raise ApiError(400, f"{name}: {why or 'not supported'}", param=name, code="unsupported_field")


def _constraint(body: Mapping[str, Any]) -> tuple[GrammarSpec | None, str]:
    """The reply's grammar from response_format, or llama-server's grammar / json_schema (at most one)."""
    given = [name for name in ("response_format", "grammar", "json_schema") if body.get(name) is not None]
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "text" and given == ["response_format"]:
        return None, ""
    if len(given) > 1:
        raise _bad(given[1], f"give one of response_format, grammar and json_schema, not {' and '.join(given)}")
    if not given:
        return None, ""
    name = given[0]
    if name == "grammar":
        grammar = _field(body, "grammar", str, "a string (a GBNF grammar)")
        return (GrammarSpec("gbnf", grammar), "grammar") if grammar.strip() else (None, "")
    if name == "json_schema":
        return GrammarSpec("json_schema", _schema_text(body["json_schema"], "json_schema")), "json_schema"
    rf = _field(body, "response_format", dict, "an object")
    kind = rf.get("type")
    if kind == "text":
        return None, ""
    if kind == "json_object":
        schema = rf.get("schema")  # llama-server also takes a schema here
        if schema is not None:
            return GrammarSpec("json_schema", _schema_text(schema, "response_format.schema")), "response_format.schema"
        return GrammarSpec("json_object"), "response_format"
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema", f"expected an object, got {_type_name(js)}")
        if js.get("name") is not None and not isinstance(js["name"], str):
            raise _bad("response_format.json_schema.name", f"expected a string, got {_type_name(js['name'])}")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise _bad("response_format.json_schema.strict", f"expected a boolean, got {_type_name(js['strict'])}")
        # Constrained decoding always holds the reply to the schema, so strict true and false both get that.
        where = "response_format.json_schema.schema"
        schema = js.get("schema")
        if schema is None:
            raise _bad(where, "is required")
        return GrammarSpec("json_schema", _schema_text(schema, where)), where
    raise _bad("response_format.type", f"expected 'text', 'json_object' or 'json_schema', got {kind!r}")


def _schema_text(schema: Any, where: str) -> str:
    if not isinstance(schema, dict | bool):
        raise _bad(where, f"expected a JSON schema (an object), got {_type_name(schema)}")
    return json.dumps(schema)


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids (as strings) to values from -100 to 100."""
    raw = _field(body, "logit_bias", dict, "an object mapping token ids to numbers")
    if raw is None:
        return ()
    out = []
    for key, value in raw.items():
        where = f"logit_bias[{key!r}]"
        if not (isinstance(key, str) and key.lstrip("-").isdigit()):
            raise _bad("logit_bias", f"keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise _bad(where, f"expected a number from -100 to 100, got {value!r}")
        out.append((int(key), float(value)))
    return tuple(out)


def check_logit_bias(gen: Generation, n_vocab: int) -> None:
    for token_id, _ in gen.logit_bias:
        if not 0 <= token_id < n_vocab:
            raise _bad("logit_bias", f"token id {token_id} is outside the vocabulary (0 to {n_vocab - 1})")


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
