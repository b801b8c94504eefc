"""Hermes 2 Pro / Qwen 2.5 calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one tag per call.

Qwen2.5-Coder often writes the same object in a ```json fence instead (recorded in tests/engine/tool_outputs);
llama.cpp's Hermes parser accepts that too, so a fenced block that is exactly one call object is a call.
"""

from __future__ import annotations

import re

from .scan import CallSpan, read_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = re.compile(r'```(?:json)?\s*(?=\{\s*"name")')
FENCE_END = re.compile(r"\s*```")


def _fenced(text: str) -> list[CallSpan]:
    found: list[CallSpan] = []
    for m in FENCE.finditer(text):
        if found and m.start() < found[-1].end:
            continue
        span = read_call(text, m.end())
        close = FENCE_END.match(text, span.end) if span else None
        if span is None or close is None:
            continue
        found.append(CallSpan(span.name, span.arguments, m.start(), close.end()))
    return found


def find_calls(text: str) -> list[CallSpan]:
    """Each well-formed tagged call, with its span widened to the tags; a malformed one and all after it stay text."""
    found: list[CallSpan] = []
    at = 0
    while (i := text.find(OPEN, at)) >= 0:
        j = i + len(OPEN)
        while j < len(text) and text[j].isspace():
            j += 1
        span = read_call(text, j)
        if span is None:
            break
        k = span.end
        while k < len(text) and text[k].isspace():
            k += 1
        if text.startswith(CLOSE, k):
            k += len(CLOSE)
        elif k < len(text):  # something else follows the object inside the tag: not a call
            break
        found.append(CallSpan(span.name, span.arguments, i, k))
        at = k
    return found or _fenced(text)
