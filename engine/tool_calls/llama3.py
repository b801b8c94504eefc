"""Llama 3.1/3.2/3.3 calls: the reply is `{"name": ..., "parameters": {...}}` (several joined by `;`), optionally
after `<|python_tag|>`. The JSON must open the reply, as in llama.cpp's Llama 3.x handler: a JSON object in the
middle of prose is prose."""

from __future__ import annotations

from .scan import CallSpan, read_call

PYTHON_TAG = "<|python_tag|>"


def find_calls(text: str) -> list[CallSpan]:
    found: list[CallSpan] = []
    at = len(text) - len(text.lstrip())
    start = at
    if text.startswith(PYTHON_TAG, at):
        at += len(PYTHON_TAG)
    while True:
        while at < len(text) and (text[at].isspace() or (found and text[at] == ";")):
            at += 1
        span = read_call(text, at) if at < len(text) else None
        if span is None:
            break
        found.append(CallSpan(span.name, span.arguments, found[-1].end if found else start, span.end))
        at = span.end
    if found and text[found[-1].end :].strip(" \n;"):  # prose after the calls: the JSON was an example, not a call
        return []
    return found
