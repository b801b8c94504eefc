"""What every command of the command line shares, local or remote: exit statuses and the one-line error, `say`,
Ctrl+C during a reply, the reply-shaping flags (`--json-schema`, `--grammar`, `--tools`) and `run --chat`'s reply.

Each backend's own side lives beside it (chatapp/local_cli.py, chatapp/remote_cli.py); chatapp/cli.py builds the
parser and picks the backend. Those modules import this one, never each other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: the commands import what they use when they run
    from engine.events import GrammarSpec, TurnStats

    from .backend import ChatBackend
    from .settings import AppSettings

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def say(msg: str) -> None:
    """A progress line or warning for the terminal user, on stderr (stdout carries the reply)."""
    print(f"chatapp: {msg}", file=sys.stderr, flush=True)


def reply_constraint(args: argparse.Namespace) -> GrammarSpec | None:
    """`--json-schema FILE|JSON` or `--grammar FILE` as a GrammarSpec; CliError naming the flag."""
    from engine.events import GrammarSpec

    if getattr(args, "json_schema", None):
        text = args.json_schema
        if not text.lstrip().startswith(("{", "[")):
            text = read_flag_file("--json-schema", text)
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise CliError(f"--json-schema: not valid JSON: {e}") from None
        return GrammarSpec("json_schema", text)
    if getattr(args, "grammar", None):
        return GrammarSpec("gbnf", read_flag_file("--grammar", args.grammar))  # GBNF, or Lark as it is
    return None


def read_flag_file(flag: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"{flag}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def run_tools(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """`--tools FILE|JSON`: OpenAI's tools array, each a function with a name; CliError naming the flag."""
    text = getattr(args, "tools", None)
    if not text:
        return None
    if not args.chat:
        raise CliError("--tools: needs --chat")
    if not text.lstrip().startswith("["):
        text = read_flag_file("--tools", text)
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"--tools: not valid JSON: {e}") from None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools
    )
    if not ok:
        raise CliError('--tools: expected an array of {"type": "function", "function": {"name": ...}}')
    return tools


def print_calls(stats: TurnStats | None) -> None:
    """A reply's tool calls on stdout, one JSON object a line (none without stats: the reply failed)."""
    for call in stats.tool_calls if stats is not None else ():
        print(json.dumps({"id": call.id, "name": call.name, "arguments": call.arguments}, ensure_ascii=False))


class Constrained:
    """A backend whose every reply is held to one constraint and offered the same tools (`run --chat`)."""

    def __init__(
        self, backend: ChatBackend, constraint: GrammarSpec | None, tools: list[dict[str, Any]] | None = None
    ) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_constraint", constraint)
        object.__setattr__(self, "_tools", tools)

    def stream_reply(self, messages, tools=None):  # noqa: ANN001, ANN201 - ChatBackend's
        tools = tools or self._tools
        if self._constraint is None:
            return self._backend.stream_reply(messages, tools)
        return self._backend.stream_reply(messages, tools, constraint=self._constraint)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._backend, name, value)


def run_chat_reply(
    backend: ChatBackend, settings: AppSettings, prompt: str, *, yes: bool = False
) -> tuple[TurnStats | None, bool]:
    """`run --chat`: one user message through the chat service (no store), the reply on stdout as it comes.
    With MCP servers configured, their tools are offered: each call is printed to stderr and asked about on
    the terminal (`yes`: every call runs unasked).

    Returns the reply's stats (None if it failed) and whether Ctrl+C stopped it."""
    from .chat_service import ChatService, ReplyError
    from .mcp.terminal import TerminalTools
    from .recorder import Recorder

    service = ChatService(
        Recorder(None, lambda _text: None),
        model_name=backend.model_name,
        settings=backend.settings,
        system_prompt=settings.system_prompt,
        backend=backend,
    )
    with TerminalTools(settings.mcp, yes=yes) as tools, ctrl_c_cancels(service.stop) as interrupted:
        try:
            reply = service.ask(prompt, lambda text: print(text, end="", flush=True), tools.chat, tools.show,
                                tools.approve)  # fmt: skip
        except ReplyError as e:
            print(flush=True)
            raise CliError(str(e)) from None
    print(flush=True)
    return reply.stats, bool(interrupted)


@contextlib.contextmanager
def ctrl_c_cancels(cancel: Callable[[], object]) -> Iterator[list[bool]]:
    """While generating, the first Ctrl+C cancels the reply (the token loop ends it with its stats); a second
    one interrupts. A KeyboardInterrupt raised inside the generator would kill it and lose the stats.

    Yields a list that is non-empty once Ctrl+C was pressed.
    """
    pressed: list[bool] = []

    def on_sigint(_signum: int, _frame: object) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)
        cancel()

    if threading.current_thread() is not threading.main_thread():  # signal handlers live on the main thread
        yield pressed
        return
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


class BackendCli(Protocol):
    """One kind of backend as the command line sees it: its flags, how it opens, and the commands that run on
    it (chatapp/local_cli.py's LOCAL, chatapp/remote_cli.py's REMOTE). `chatapp.cli.backend_cli` picks one."""

    picks_models: bool
    """Whether the TUI's model picker offers the local models (a server's model is chosen with -m)."""

    def add_args(self, p: argparse.ArgumentParser) -> None:
        """This backend's own flags."""
        ...

    def overrides(self, args: argparse.Namespace) -> dict[str, Any]:
        """The settings layer of those flags (absent ones left out)."""
        ...

    def open(self, args: argparse.Namespace, settings: AppSettings, progress: Callable[[str], None]) -> ChatBackend:
        """The chat backend the settings name, loaded or connected, with progress lines through `progress`."""
        ...

    def label(self, args: argparse.Namespace, settings: AppSettings) -> str:
        """What the TUI calls the model until `open` has returned."""
        ...

    def run(self, args: argparse.Namespace, settings: AppSettings) -> int:
        """`chatapp run`: the reply on stdout, the summary on stderr; the exit status."""
        ...

    def bench(self, args: argparse.Namespace, settings: AppSettings) -> int:
        """`chatapp bench`; the exit status."""
        ...
