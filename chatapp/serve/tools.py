"""The tool-calling and reasoning fields of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`,
`chat_template_kwargs`, tool messages) checked into a `ToolRequest`, and OpenAI's reply shapes for calls.

Tool definitions are untrusted text: they reach the model only through its chat template, and their parameter
schemas must be valid JSON Schemas (checked with `jsonschema`), or the request gets a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from engine.constraint import GrammarSpec
from engine.events import ToolCall, ToolSpec
from engine.tool_calls import CallFormat
from engine.tool_calls.grammar import tool_grammar
from engine.tool_calls.stream import Delta

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("auto", "none", "required")


def _bad(param: str, message: str) -> Exception:
    from .schema import ApiError  # here: schema imports this module

    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[ToolSpec, ...] = ()
    choice: str = "auto"  # "auto" | "none" | "required" | "function" (then `name`)
    name: str = ""  # the tool a named tool_choice asks for
    parallel: bool = True  # parallel_tool_calls: false keeps only the first call
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether the reply is read for calls (tools offered and not switched off)."""
        return bool(self.tools) and self.choice != "none"

    def constraint(self, fmt: CallFormat) -> GrammarSpec | None:
        """The calls' grammar: lazy at the format's trigger with `auto`, from the first token otherwise."""
        if not self.active:
            return None
        only = self.name if self.choice == "function" else None
        return tool_grammar(fmt.name, self.tools, only, lazy=self.choice == "auto", parallel=self.parallel)


def _tool(value: Any, i: int) -> ToolSpec:
    where = f"tools[{i}]"
    if not isinstance(value, dict):
        raise _bad(where, "expected an object")
    if value.get("type", "function") != "function":
        raise _bad(f"{where}.type", f"only 'function' tools are supported, got {value.get('type')!r}")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{where}.function", "expected an object with a name")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise _bad(f"{where}.function.name", f"expected 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"{where}.function.description", "expected a string")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "expected a JSON Schema object")
        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as e:
            path = "".join(f"[{p!r}]" for p in e.path)
            raise _bad(f"{where}.function.parameters", f"not a valid JSON Schema{path}: {e.message}") from None
    return {"type": "function", "function": fn}


def parse_tools(body: Mapping[str, Any]) -> ToolRequest:
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise _bad("tools", "expected an array")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw or []))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tools", f"two tools are named {next(n for n in names if names.count(n) > 1)!r}")
    choice, name = "auto", ""
    value = body.get("tool_choice")
    if isinstance(value, str):
        if value not in CHOICES:
            raise _bad("tool_choice", f"expected one of {', '.join(CHOICES)} or a function, got {value!r}")
        choice = value
    elif isinstance(value, dict):
        fn = value.get("function")
        called = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type") != "function" or not isinstance(called, str):
            raise _bad("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
        name = called
        if name not in names:
            offered = ", ".join(names) or "none"
            raise _bad("tool_choice", f"names the tool {name!r}, which is not in tools (offered: {offered})")
        choice = "function"
    elif value is not None:
        raise _bad("tool_choice", "expected a string or an object")
    if choice in ("required", "function") and not tools:
        raise _bad("tool_choice", f"{choice!r} needs tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "expected a boolean")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "expected an object")
    return ToolRequest(tools, choice, name, parallel, kwargs)


def parse_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`."""
    if not isinstance(value, list):
        raise _bad(where, "expected an array")
    calls = []
    for i, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}[{i}].function", "expected an object with a name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(str(c.get("id") or f"call_{i}"), fn["name"], args))
    return tuple(calls)


def call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def delta_json(d: Delta) -> dict[str, Any]:
    """A streamed call delta, OpenAI's shape: the id, type and name come once, then the arguments in pieces."""
    if d.id:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


def kept(calls: Sequence[ToolCall], req: ToolRequest) -> tuple[ToolCall, ...]:
    return tuple(calls if req.parallel else calls[:1])
