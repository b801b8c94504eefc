"""A chat's reply format: the JSON schema or grammar every reply must match, as `run --json-schema/--grammar`.

In the app: `/format json FILE|JSON`, `/format grammar FILE` (GBNF, or Lark as it is), `/format off`, or the
palette's "Reply format"; `--json-schema` / `--grammar` at start. The format is a `GrammarSpec`: the engine's
sampler enforces it (engine.constraint), and a remote backend sends it as the server's field for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from chatapp.backend import ChatBackend
from engine.events import GrammarSpec, Message, TokenEvent, ToolSpec, TurnStats

COMMAND = "/format"
USAGE = "json FILE|JSON · grammar FILE (GBNF or Lark) · off"


class FormatError(ValueError):
    """The format cannot be used; the message names what is wrong, for the user."""


def is_format_command(message: str) -> bool:
    head = message.strip()
    return head == COMMAND or head.startswith(COMMAND + " ")


def parse_format(text: str, cwd: Path | None = None) -> GrammarSpec | None:
    """`json FILE|JSON`, `grammar FILE` or `off` (None: free text again) as a GrammarSpec; FormatError if not."""
    kind, _, arg = text.strip().partition(" ")
    arg = arg.strip()
    if kind in ("off", "none", "clear") and not arg:
        return None
    if kind in ("json", "schema") and arg:
        source = arg if arg.startswith(("{", "[")) else _read(arg, cwd)
        try:
            json.loads(source)
        except json.JSONDecodeError as e:
            raise FormatError(f"the JSON schema is not valid JSON: {e}") from None
        return GrammarSpec("json_schema", source)
    if kind == "grammar" and arg:
        return GrammarSpec("gbnf", _read(arg, cwd))  # the engine takes Lark as it is
    raise FormatError(f"expected {USAGE}")


def _read(spec: str, cwd: Path | None) -> str:
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"cannot read {spec}: {getattr(e, 'strerror', None) or e}") from None


def label(spec: GrammarSpec | None) -> str:
    """What the status line shows: "json schema", "grammar", or "" for free text."""
    if spec is None:
        return ""
    return "json schema" if spec.kind in ("json_schema", "json_object") else "grammar"


def check_format(backend: ChatBackend | None, spec: GrammarSpec) -> None:
    """Compile `spec` for the local model's vocabulary (cached for its replies); FormatError naming the fault.

    A remote backend (no tokenizer here), or none loaded yet, leaves the check to the reply itself."""
    tokenizer = getattr(getattr(backend, "model", None), "tokenizer", None)
    if tokenizer is None:
        return
    from engine.constraint import compile_grammar
    from engine.errors import GrammarError

    try:
        compile_grammar(tokenizer, spec)
    except GrammarError as e:
        raise FormatError(str(e)) from None


class Constrained:
    """`backend` with every `stream_reply` held to `spec` (tools are still passed; the format wins)."""

    def __init__(self, backend: ChatBackend, spec: GrammarSpec) -> None:
        self._backend, self._spec = backend, spec

    def stream_reply(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None = None
    ) -> Iterator[TokenEvent | TurnStats]:
        return self._backend.stream_reply(messages, tools, constraint=self._spec)  # type: ignore[call-arg]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def constrained(backend: ChatBackend, spec: GrammarSpec | None) -> ChatBackend:
    """`backend` held to `spec`; `backend` itself when there is no format."""
    return backend if spec is None else Constrained(backend, spec)  # type: ignore[return-value]
