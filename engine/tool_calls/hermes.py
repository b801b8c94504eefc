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
    """Each well-formed tagged call, with its span widened to the tags; a malformed one and all after it stay text.

    One tag may hold several objects one after another (Qwen2.5-Coder writes its second call that way), and a
    missing closing tag is forgiven when the next thing is another call or the end.
    """
    found: list[CallSpan] = []
    at = 0
    while (i := text.find(OPEN, at)) >= 0:
        j, spans = i + len(OPEN), []
        while True:
            j = _skip_space(text, j)
            span = read_call(text, j)
            if span is None:
                break
            spans.append(span)
            j = span.end
        if not spans:
            break
        if text.startswith(CLOSE, j):
            j += len(CLOSE)
        elif j < len(text) and not text.startswith(OPEN, j):  # something else follows inside the tag
            break
        starts = [i] + [s.end for s in spans[:-1]]
        ends = [s.end for s in spans[:-1]] + [j]
        found.extend(CallSpan(s.name, s.arguments, a, b) for s, a, b in zip(spans, starts, ends, strict=True))
        at = j
    return found or _fenced(text)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
