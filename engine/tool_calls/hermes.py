"""Hermes 2 Pro / Qwen 2.5 calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one tag per call."""

from __future__ import annotations

from .scan import CallSpan, read_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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
    return found
