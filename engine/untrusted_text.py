"""Untrusted text never becomes a control token.

A chat template writes its own markers (`<|im_start|>`, `<start_of_turn>`) around the conversation's text, and the
prompt is tokenized with special tokens on so that those markers are control tokens. Whatever a person typed, a
file held, a client sent or a tool returned must stay text even when it spells a marker: otherwise a message
can close its own turn and open a system turn.

So the conversation's strings are marked before rendering: in each string, the stretch from the first control
token's text to the last one's is wrapped in a pair of markers that nobody can guess (a fresh random nonce per
render). The template runs as usual (it may strip, split or join the strings; the markers ride along), and
`unmark` takes the markers out again, returning the plain text the template produced and the character spans
the tokenizer must read as text (`Tokenizer.tokenize(text, plain_spans=...)`). A string with no control text in
it is left alone, so an ordinary conversation renders exactly as before.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from engine.events import Message, ToolCall


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt as the template wrote it, and where in it the conversation's untrusted text sits."""

    text: str
    plain_spans: tuple[tuple[int, int], ...] = ()  # (start, end) character ranges read as text, in order


class TextGuard:
    """Marks the control-token texts in a conversation's strings, and finds them again after rendering."""

    def __init__(self, control_texts: Collection[str]) -> None:
        self._texts = frozenset(t for t in control_texts if t)
        self._lengths = sorted({len(t) for t in self._texts}, reverse=True)
        starts = sorted({t[0] for t in self._texts})
        self._starts = re.compile("[" + "".join(re.escape(c) for c in starts) + "]") if starts else None
        nonce = secrets.token_hex(8)
        self.open = f"\ue000{nonce}\ue001"
        self.close = f"\ue001{nonce}\ue000"

    def control_stretch(self, text: str) -> tuple[int, int] | None:
        """From the first control text's start to the last one's end in `text`; None when there is none."""
        if self._starts is None:
            return None
        first = last = -1
        at = 0
        while (found := self._starts.search(text, at)) is not None:
            i = found.start()
            size = next((n for n in self._lengths if text[i : i + n] in self._texts), 0)
            if size:
                first = i if first < 0 else first
                last = i + size
                at = i + size
            else:
                at = i + 1
        return (first, last) if first >= 0 else None

    def mark(self, value: Any) -> Any:
        """`value` with its strings' control stretches wrapped in markers: strings, messages, tool calls, and the
        lists and mappings of them (a template's `tools`) are walked; anything else is returned as it is."""
        if isinstance(value, str):
            stretch = self.control_stretch(value)
            if stretch is None:
                return value
            start, end = stretch
            return f"{value[:start]}{self.open}{value[start:end]}{self.close}{value[end:]}"
        if isinstance(value, (Message, ToolCall)):
            changes = {f.name: self.mark(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return dataclasses.replace(value, **changes)
        if isinstance(value, Mapping):
            return {key: self.mark(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.mark(item) for item in value)
        return value

    def unmark(self, text: str) -> RenderedPrompt:
        """The rendered text without markers, and the spans they enclosed. A marker the template cut off from its
        partner (it sliced or split a string) is dropped, and encloses nothing."""
        parts = re.split(f"({re.escape(self.open)}|{re.escape(self.close)})", text)
        out: list[str] = []
        size = 0
        spans: list[tuple[int, int]] = []
        opened: int | None = None
        for part in parts:
            if part == self.open:
                opened = size
            elif part == self.close:
                if opened is not None and size > opened:
                    spans.append((opened, size))
                opened = None
            else:
                out.append(part)
                size += len(part)
        return RenderedPrompt("".join(out), tuple(spans))
