"""Chat templates: turn a conversation into the prompt text the model was trained on.

A GGUF file carries its chat template as Jinja source (`tokenizer.chat_template`), rendered the way Hugging
Face transformers renders it. The file was downloaded, so the template is untrusted code. It runs in Jinja's
immutable sandbox, where any reach for an internal attribute (`__class__`, `__globals__`, `_private`) raises
SecurityError at once, and under limits on output size, sequence size and time. Anything that goes wrong
switches the template to a built-in turn format for good, with one warning: the first of `TURN_FORMATS` whose
markers are special tokens of the model's vocabulary (Gemma's `<start_of_turn>`, Llama 3's headers), else ChatML,
llama.cpp's default. Markers that are not tokens would reach the model as plain text, which it echoes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from types import FrameType
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import TemplateError
from engine.events import Message, ToolSpec
from engine.untrusted_text import RenderedPrompt, TextGuard

MAX_SOURCE_CHARS = 1_000_000  # real templates are a few KB
MAX_OUTPUT_CHARS = 1_000_000  # a prompt this long is far beyond any context window
MAX_INT_ARG = MAX_OUTPUT_CHARS  # no call from a template needs a bigger number (range, center, lipsum...)
MAX_POW_BITS = 4096  # `**` results beyond this are a CPU/memory bomb, not a chat prompt
RENDER_TIME_LIMIT_S = 2.0  # real templates render in milliseconds

_PROBE_USER = "chatapp-probe-user-1f9c"
_PROBE_ASSISTANT = "chatapp-probe-assistant-1f9c"


class _RenderTimeout(BaseException):
    # BaseException: nothing inside Jinja's runtime catches it on its way out.
    pass


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training; we keep the body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _CodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to a size-checked join, so a doubling loop (`{% set ns.s = ns.s ~ ns.s %}`)
    fails at 1 MB instead of exhausting memory between two checks of the time limit."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, made stricter: unsafe attributes raise instead of rendering as empty, and
    the cheap size bombs (`'x' * 10**9`, `9 ** 10**9`, `range(10**9)`, doubling a string with `~` or `+`)
    raise before they allocate."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+"})

    @staticmethod
    def checked_concat(values: Sequence[Any]) -> str:
        parts = [str(v) for v in values]
        if sum(len(p) for p in parts) > MAX_OUTPUT_CHARS:
            raise SecurityError(f"a string over {MAX_OUTPUT_CHARS} characters")
        return "".join(parts)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and right * max(abs(left).bit_length(), 1) > MAX_POW_BITS:
                    raise SecurityError(f"{left} ** {right} is too large")
            return left**right
        if operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > MAX_OUTPUT_CHARS:
                    raise SecurityError(f"a sequence over {MAX_OUTPUT_CHARS} items")
            return left + right
        # "*": refuse to build a string or list longer than any prompt
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                if len(seq) * times > MAX_OUTPUT_CHARS:
                    raise SecurityError(f"a sequence of {len(seq)} repeated {times} times is too large")
        return left * right

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > MAX_INT_ARG:
                name = getattr(__obj, "__name__", "a call")
                raise SecurityError(f"argument {value} to {name} is too large")
        return super().call(__context, __obj, *args, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # HF's filter: unlike Jinja's own tojson it does not HTML-escape, and it takes json.dumps' options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _RenderTimeout in this thread once `seconds` have passed, checked on every Python line.

    A sandboxed loop with no output (`{% for i in range(10**5) %}{% for j in range(10**5) %}...`) would
    otherwise spin for hours. sys.settrace is per thread; a debugger's or coverage's tracer is restored
    afterwards (and misses the lines run in between).
    """
    deadline = time.monotonic() + seconds

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _RenderTimeout(f"rendering took longer than {seconds:g} s")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


@dataclass(frozen=True)
class TurnFormat:
    """A chat format built in, for a model whose file has no usable template."""

    name: str
    turn: str  # one message, with {role} and {content}
    generation_prompt: str  # what opens the assistant's turn
    markers: tuple[str, ...]  # the special tokens it is written in; the vocabulary must have them all
    roles: dict[str, str] = field(default_factory=dict)  # role renames: Gemma's assistant is "model"
    system_in_first_user: bool = False  # no system role: its text opens the first user turn (Gemma)
    trim: bool = False  # contents are stripped, as the family's own template does

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        turns = [dict(m) for m in messages]
        if self.system_in_first_user and turns and turns[0]["role"] == "system":
            system = turns.pop(0)["content"]
            if turns and turns[0]["role"] == "user":
                turns[0]["content"] = f"{system}\n\n{turns[0]['content']}"
            else:
                turns.insert(0, {"role": "user", "content": system})
        text = "".join(
            self.turn.format(
                role=self.roles.get(m["role"], m["role"]), content=m["content"].strip() if self.trim else m["content"]
            )
            for m in turns
        )
        return text + (self.generation_prompt if add_generation_prompt else "")


CHATML = TurnFormat(
    "ChatML", "<|im_start|>{role}\n{content}<|im_end|>\n", "<|im_start|>assistant\n", ("<|im_start|>", "<|im_end|>")
)
TURN_FORMATS = (
    CHATML,
    TurnFormat(
        "Gemma's turn format",
        "<start_of_turn>{role}\n{content}<end_of_turn>\n",
        "<start_of_turn>model\n",
        ("<start_of_turn>", "<end_of_turn>"),
        roles={"assistant": "model"},
        system_in_first_user=True,
        trim=True,
    ),
    TurnFormat(
        "Llama 3's turn format",
        "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        trim=True,
    ),
)


def fallback_format(special_tokens: Collection[str]) -> TurnFormat:
    """The built-in format the vocabulary is written for: the first whose markers are all special tokens."""
    return next((f for f in TURN_FORMATS if all(m in special_tokens for m in f.markers)), CHATML)


class ChatTemplate:
    """A model's chat template, or a built-in turn format when the model has none or its template fails."""

    def __init__(
        self,
        source: str | None,
        bos_token: str,
        eos_token: str,
        special_tokens: Collection[str] = (),
        control_tokens: Collection[str] = (),
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.fallback = fallback_format(special_tokens)
        """What renders the conversation when the template cannot: chosen from the vocabulary's special tokens."""
        self.guard = TextGuard(control_tokens)
        """Keeps the conversation's text from becoming control tokens (`render_prompt`)."""
        self.warning: str | None = None
        """Why the model's template is not used, set once; None while it works."""
        self._template: Any = None
        self._end_strings: list[str] | None = None
        if not source or not source.strip():
            self._fail("the model has no chat template")
        elif len(source) > MAX_SOURCE_CHARS:
            self._fail(f"chat template is {len(source)} characters, over {MAX_SOURCE_CHARS}")
        else:
            try:
                # Compiling folds constant expressions, i.e. runs template code: limit it too.
                with _time_limit(RENDER_TIME_LIMIT_S):
                    self._template = _environment().from_string(source)
            except (Exception, _RenderTimeout) as e:  # a syntax error, or anything else the compiler refuses
                self._fail(f"chat template does not compile ({_describe(e)})")

    @classmethod
    def from_metadata(
        cls,
        template_source: str | None,
        bos_token: str,
        eos_token: str,
        special_tokens: Collection[str] = (),
        control_tokens: Collection[str] = (),
    ) -> ChatTemplate:
        """Build from the GGUF's `tokenizer.chat_template`, the BOS/EOS token texts, the special tokens' texts and
        the control tokens' texts (those that only the template may write)."""
        return cls(template_source, bos_token, eos_token, special_tokens, control_tokens)

    @property
    def uses_fallback(self) -> bool:
        return self._template is None

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[ToolSpec] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opener if asked.

        `tools` reach the template as `tools`, and `kwargs` (a request's `chat_template_kwargs`, such as
        `enable_thinking`) as variables of their own, as transformers' `apply_chat_template` passes them.

        The first failure switches this template to its fallback format for good: the prompt for earlier turns must not
        change format mid-conversation (the KV cache reuses it), and a hostile template runs only once.
        """
        dicts = [message_dict(m) for m in messages]
        if self._template is not None:
            try:
                text = self._render(dicts, add_generation_prompt, tools, kwargs)
            except (Exception, _RenderTimeout) as e:  # SecurityError, UndefinedError, TemplateError, ...
                self._fail(f"chat template failed ({_describe(e)})")
            else:
                if text.strip():
                    return text
                self._fail("chat template rendered an empty prompt")
        return self.fallback.render([_plain(d) for d in dicts], add_generation_prompt)

    def render_prompt(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[ToolSpec] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> RenderedPrompt:
        """`render`, with the spans where the messages' own text (and the tools' and kwargs' text) landed: tokenize
        the text with special tokens on and these spans as plain text, so only the template's markers become
        control tokens."""
        guard = self.guard
        marked_tools = guard.mark(list(tools)) if tools else tools
        marked_kwargs = guard.mark(dict(kwargs)) if kwargs else kwargs
        text = self.render(guard.mark(list(messages)), add_generation_prompt, marked_tools, marked_kwargs)
        return guard.unmark(text)

    def end_of_turn_strings(self) -> list[str]:
        """Strings the template closes an assistant turn with (e.g. '<|im_end|>', '<|eot_id|>', '</s>').

        Found by rendering a probe conversation: whatever follows the assistant's text. The chat layer maps
        them to token ids to stop generation.
        """
        if self._end_strings is None:
            probe = [Message("user", _PROBE_USER), Message("assistant", _PROBE_ASSISTANT)]
            text = self.render(probe, add_generation_prompt=False)
            at = text.rfind(_PROBE_ASSISTANT)
            tail = text[at + len(_PROBE_ASSISTANT) :] if at >= 0 else ""
            found = list(dict.fromkeys(tail.split()))  # "<|im_end|>\n" -> ["<|im_end|>"]; order kept
            self._end_strings = found or ([self.eos_token] if self.eos_token else [])
        return list(self._end_strings)

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[ToolSpec] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        context = {
            **(kwargs or {}),  # first: a kwarg never replaces the conversation itself
            "messages": messages,
            "tools": [dict(t) for t in tools] if tools else None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        parts: list[str] = []
        size = 0
        with _time_limit(RENDER_TIME_LIMIT_S):
            for part in self._template.generate(context):
                size += len(part)
                if size > MAX_OUTPUT_CHARS:
                    raise SecurityError(f"output is over {MAX_OUTPUT_CHARS} characters")
                parts.append(part)
        return "".join(parts)

    def _fail(self, reason: str) -> None:
        self._template = None
        if self.warning is None:
            self.warning = f"{reason}; using {self.fallback.name}"


def message_dict(m: Message) -> dict[str, Any]:
    """A message as chat templates read it (transformers' shape): calls' arguments as objects when they parse."""
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args: Any = json.loads(c.arguments)
            except ValueError:
                args = c.arguments
            calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
        d["tool_calls"] = calls
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    if m.reasoning:
        d["reasoning_content"] = m.reasoning
    return d


def _plain(d: dict[str, Any]) -> dict[str, str]:
    """A message for a built-in turn format, which has no tool syntax: calls as JSON text, results as user text."""
    content = d["content"]
    if d.get("tool_calls"):
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in d["tool_calls"]]
        content = (content + "\n" if content else "") + json.dumps({"tool_calls": calls}, ensure_ascii=False)
    role = d["role"]
    if role == "tool":
        role, content = "user", f"Result of {d.get('name') or 'the call'}: {content}"
    return {"role": role, "content": content}


def _describe(e: BaseException) -> str:
    text = str(e).strip().replace("\n", " ")
    name = "timeout" if isinstance(e, _RenderTimeout) else type(e).__name__
    return f"{name}: {text[:200]}" if text else name
