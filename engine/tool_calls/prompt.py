"""The prompt for a conversation with tools: the template renders them itself when it has tool syntax; else
they are described, with the generic envelope, in the system prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from engine.events import Message, ToolSpec
from engine.template import ChatTemplate
from engine.untrusted_text import RenderedPrompt

from . import CallFormat, detect_format, generic


def call_format(template: ChatTemplate) -> CallFormat:
    """The format this template's model writes calls in (generic when its template is not in use)."""
    return detect_format(None if template.uses_fallback else template.source)


def render(
    template: ChatTemplate,
    messages: Sequence[Message],
    tools: Sequence[ToolSpec] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> RenderedPrompt:
    """The prompt text, tools included the way the model's format expects them, with the spans that hold the
    conversation's and the tools' own text (never control tokens: engine.untrusted_text)."""
    if not tools:
        return template.render_prompt(messages, add_generation_prompt, None, kwargs)
    fmt = call_format(template)
    if fmt.native:
        return template.render_prompt(messages, add_generation_prompt, tools, kwargs)
    note = generic.system_text(tools)
    msgs = list(messages)
    if msgs and msgs[0].role == "system":
        msgs[0] = replace(msgs[0], content=f"{msgs[0].content}\n\n{note}")
    else:
        msgs.insert(0, Message("system", note))
    return template.render_prompt(msgs, add_generation_prompt, None, kwargs)
