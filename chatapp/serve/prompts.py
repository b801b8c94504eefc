"""Requests to token ids: chat messages through the model's template, text as it is (with BOS where the model
wants one), token ids checked against the vocabulary."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.chat import prompt_ids
from engine.events import Message, ToolSpec
from engine.tool_calls import CallFormat
from engine.tool_calls import prompt as tool_prompt
from engine.tool_calls.reasoning import opens_thinking

from .schema import ApiError, check_token_ids

if TYPE_CHECKING:
    from engine import Model
    from engine.template import ChatTemplate


class Prompter:
    """Thread-safe: every chat request renders with its own copy of the template."""

    def __init__(self, model: Model, template: ChatTemplate) -> None:
        self.model = model
        self.template = template

    def chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        prefix: str = "",
    ) -> list[int]:
        """The prompt's ids: the messages and `tools` through the template (with its `kwargs`), then `prefix`,
        the forced start of the reply."""
        # A template that raises switches itself to its fallback format for good (right for one conversation). Here one
        # client's odd messages must not change every later prompt, so each render gets a copy, and a template
        # that refuses the messages is the client's error.
        template = copy.copy(self.template)
        prompt = tool_prompt.render(template, messages, tools, kwargs)
        if template.uses_fallback and not self.template.uses_fallback:
            message = f"messages: the model's chat template refused them: {template.warning}"
            raise ApiError(400, message, param="messages")
        # The messages' and tools' text is text, never control tokens; the prefix is ours.
        return prompt_ids(self.model.tokenizer, replace(prompt, text=prompt.text + prefix))

    @property
    def call_format(self) -> CallFormat:
        return tool_prompt.call_format(self.template)

    def opens_thinking(self, kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the generation prompt itself opens a `<think>` block (then the reply starts inside it)."""
        template = copy.copy(self.template)
        probe = template.render([Message("user", "x")], add_generation_prompt=True, kwargs=kwargs)
        return opens_thinking(probe)

    def text(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self._with_bos(self.model.tokenize(prompt, special=True))
        else:
            ids = list(prompt)
            check_token_ids(ids, self.model.n_vocab)
        if not ids:
            raise ApiError(400, "prompt: is empty", param="prompt")
        return ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        tok = self.model.tokenizer
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
        return ids
