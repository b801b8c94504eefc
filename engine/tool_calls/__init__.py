"""Tool calls in model output: which format a model writes (read from its chat template, as llama.cpp's chat
handlers do), how to read calls out of a finished reply, and how to split a reply into content and call deltas
while it streams.

One module per format holds its parser; the table below is the one place that maps templates to formats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.events import ToolCall

from . import generic, hermes, llama3, mistral
from .scan import CallSpan, new_id

__all__ = ["FORMATS", "CallFormat", "Parsed", "detect_format", "parse_reply"]


@dataclass(frozen=True)
class CallFormat:
    name: str
    find_calls: Callable[[str], list[CallSpan]]
    triggers: tuple[str, ...]  # text that opens a call, anywhere in the reply
    at_start: tuple[str, ...]  # text that opens a call only when it opens the reply
    native: bool  # the template renders `tools` itself; else the tools go into the system prompt
    fenced: bool = False  # a ```json fence holding a call object also opens a call (Qwen2.5-Coder writes them)


FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat("hermes", hermes.find_calls, (hermes.OPEN,), (), True, fenced=True),
    "llama3": CallFormat("llama3", llama3.find_calls, (llama3.PYTHON_TAG,), ("{",), True),
    "mistral": CallFormat("mistral", mistral.find_calls, (mistral.MARKER,), (), True),
    "generic": CallFormat("generic", generic.find_calls, (), ("{",), False),
}

# (text in the template source, format): the first match wins.
_DETECT = (
    ("<tool_call>", "hermes"),  # Hermes 2 Pro, Qwen 2.5 / 3
    ("[TOOL_CALLS]", "mistral"),  # Mistral Nemo, Small
    ("<|python_tag|>", "llama3"),  # Llama 3.1+
    ("ipython", "llama3"),  # Llama 3.2/3.3 templates name the tool role ipython
)


def detect_format(template_source: str | None) -> CallFormat:
    """The call format a model's template is written for; the generic JSON envelope when it has none."""
    src = template_source or ""
    for needle, name in _DETECT:
        if needle in src:
            return FORMATS[name]
    return FORMATS["generic"]


@dataclass(frozen=True)
class Parsed:
    content: str  # the reply without its calls (stripped when calls were found)
    calls: tuple[ToolCall, ...]


def parse_reply(text: str, fmt: CallFormat, ids: tuple[str, ...] = ()) -> Parsed:
    """The calls in a finished reply and the text around them; malformed calls stay text.

    `ids`: ids already given to these calls (e.g. while streaming), used in order before new ones.
    """
    spans = fmt.find_calls(text)
    if not spans:
        return Parsed(text, ())
    parts, at = [], 0
    for s in spans:
        parts.append(text[at : s.start])
        at = s.end
    parts.append(text[at:])
    calls = tuple(ToolCall(ids[i] if i < len(ids) else new_id(), s.name, s.arguments) for i, s in enumerate(spans))
    return Parsed("".join(parts).strip(), calls)
