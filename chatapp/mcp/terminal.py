"""Tools for `chatapp run --chat`: start the servers, print each call to stderr, ask on the terminal."""

from __future__ import annotations

import sys
from typing import TextIO

from chatapp.chat_state import ToolRecord
from chatapp.export import pretty_arguments
from chatapp.mcp.client import McpClient
from chatapp.mcp.config import McpSettings
from chatapp.mcp.loop import ToolChat

ANSWERS = {"y": "once", "yes": "once", "a": "always", "always": "always"}


class TerminalTools:
    """A context: the servers run inside it; `chat` is None when no tool is available."""

    def __init__(self, settings: McpSettings, *, yes: bool = False, stdin: TextIO | None = None,
                 stderr: TextIO | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.yes = yes
        self.stdin = stdin or sys.stdin
        self.stderr = stderr or sys.stderr
        self.client: McpClient | None = None
        self.chat: ToolChat | None = None

    def __enter__(self) -> TerminalTools:
        if not self.settings.servers:
            return self
        self.client = McpClient(self.settings)
        for line in self.client.start():
            self._say(f"warning: {line}")
        tools = self.client.tools
        if tools:
            self._say(f"{len(tools)} tools: " + ", ".join(f"{t.name} ({t.server})" for t in tools))
            allowed = {t.name for t in tools} if self.yes else set(self.settings.allow)
            self.chat = ToolChat(tools, self.client.call, allowed, self.settings.max_rounds)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.client is not None:
            self.client.close()

    def _say(self, text: str) -> None:
        print(f"chatapp: {text}", file=self.stderr, flush=True)

    def show(self, record: ToolRecord) -> None:
        """Each call once when it appears, and once with its result."""
        if record.status == "asking":
            return
        if record.status == "running":
            args = " ".join(pretty_arguments(record.arguments).split())
            self._say(f"tool call: {record.name} on {record.server or '?'} {args}")
        elif record.status == "ok":
            lines = record.result.splitlines() or [""]
            more = f" (+{len(lines) - 1} lines)" if len(lines) > 1 else ""
            self._say(f"tool result: {record.name} ({record.ms:.0f} ms): {lines[0][:200]}{more}")
        else:
            self._say(f"tool {record.status}: {record.name}: {' '.join(record.result.split())}")

    def approve(self, record: ToolRecord) -> str:
        """Ask on the terminal: y once, a always (this run), anything else denies."""
        args = " ".join(pretty_arguments(record.arguments).split())
        print(f"chatapp: run {record.name} on {record.server or '?'} {args}? [y]es once, [a]lways, [N]o: ",
              end="", file=self.stderr, flush=True)  # fmt: skip
        line = self.stdin.readline()
        return ANSWERS.get(line.strip().lower(), "deny")
