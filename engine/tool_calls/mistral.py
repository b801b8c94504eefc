"""Mistral Nemo / Small calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]`."""

from __future__ import annotations

from .scan import CallSpan, read_call

MARKER = "[TOOL_CALLS]"


def read_array(text: str, at: int, opened: int) -> list[CallSpan]:
    """The call objects of the JSON array at `at` (`[` expected); the first span starts at `opened`."""
    while at < len(text) and text[at].isspace():
        at += 1
    if not text.startswith("[", at):
        return []
    at += 1
    found: list[CallSpan] = []
    while True:
        while at < len(text) and (text[at].isspace() or (found and text[at] == ",")):
            at += 1
        span = read_call(text, at)
        if span is None:
            break
        found.append(span)
        at = span.end
    while at < len(text) and text[at].isspace():
        at += 1
    if not found or not text.startswith("]", at):
        return []
    # Spans tile the whole array, separators included, so none of it is left as content.
    starts = [opened] + [s.end for s in found[:-1]]
    ends = [s.end for s in found[:-1]] + [at + 1]
    return [CallSpan(s.name, s.arguments, a, b) for s, a, b in zip(found, starts, ends, strict=True)]


def find_calls(text: str) -> list[CallSpan]:
    i = text.find(MARKER)
    return [] if i < 0 else read_array(text, i + len(MARKER), i)
