"""Models whose template has no tool syntax (SmolLM2, Gemma): the tools and this envelope are described in the
system prompt, and a call is a reply that is `{"tool_calls": [{"name": ..., "arguments": {...}}]}`, as in
llama.cpp's generic handler."""

from __future__ import annotations

import json
from collections.abc import Sequence

from engine.events import ToolSpec

from .mistral import read_array
from .scan import CallSpan

KEY = '{"tool_calls":'


def find_calls(text: str) -> list[CallSpan]:
    start = len(text) - len(text.lstrip())
    body = text[start:]
    compact = body.replace(" ", "").replace("\n", "")
    if not compact.startswith(KEY):
        return []
    at = text.index(":", start) + 1
    found = read_array(text, at, start)
    if not found:
        return []
    end = found[-1].end
    while end < len(text) and text[end].isspace():
        end += 1
    if not text.startswith("}", end):
        return []
    last = found[-1]
    found[-1] = CallSpan(last.name, last.arguments, last.start, end + 1)
    return found


def system_text(tools: Sequence[ToolSpec]) -> str:
    """What the system prompt says, for a template that does not render tools itself."""
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "You can call these functions:\n"
        f"{listing}\n"
        "To call functions, reply with only this JSON and nothing else: "
        '{"tool_calls": [{"name": "<function name>", "arguments": {<arguments>}}]}\n'
        "Otherwise answer in plain text."
    )
