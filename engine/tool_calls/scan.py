"""Finding where a JSON value ends in text that may still be growing, and reading a call object out of it.

Every format's parser and the streaming splitter use the same scanner, so the arguments a client assembles
from streamed deltas are exactly the text the final parse returns.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value (object, array or string) that starts at `start`; None while open.

    Only the nesting and the strings are tracked: whether the value is valid JSON is `json.loads`'s job later.
    """
    depth = 0
    in_string = escape = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
        elif depth == 0 and not c.isspace():
            return None  # not an object, array or string: a number or a word is not a call's value
    return None


def new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallSpan:
    """One call object found in text: where it is and what it says."""

    name: str
    arguments: str  # the raw JSON text of the arguments value, as written
    start: int  # the object's opening brace
    end: int  # just past its closing brace


def read_call(text: str, start: int) -> CallSpan | None:
    """The `{"name": ..., "arguments"|"parameters": {...}}` object at `start`, or None when it is not one.

    Malformed, unfinished or extra-keyed-beyond-reason objects give None: the caller keeps them as text.
    """
    end = value_end(text, start)
    if end is None or text[start] != "{":
        return None
    raw = text[start:end]
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    m = _ARGS.search(raw)
    if m is None:
        return CallSpan(obj["name"], "{}", start, end) if set(obj) == {"name"} else None
    args_end = value_end(raw, m.end())
    if args_end is None:
        return None
    arguments = raw[m.end() : args_end]
    value = json.loads(arguments)
    if isinstance(value, str):  # some models write the arguments as a JSON string holding the object
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        if not isinstance(inner, dict):
            return None
        arguments = value
    elif not isinstance(value, dict):
        return None
    return CallSpan(obj["name"], arguments, start, end)
