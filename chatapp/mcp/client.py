"""The MCP client: every configured server's session on one asyncio loop in its own thread.

The app's threads call `start`, `call` and `close`, which block until the loop has done the work; nothing else
touches the sessions. Each server lives in one task that opens its transport and session and holds them until
`close` (the SDK's context managers must be left in the task that entered them). Every failure comes back as
one line for the user: a server that does not start, crashes or hangs (`timeout`), a tool that raises, a result
that is not text.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from chatapp.errors import describe_error
from chatapp.mcp.config import McpSettings, ServerSpec
from engine.events import ToolSpec


@dataclass(frozen=True)
class McpTool:
    name: str
    server: str
    description: str
    input_schema: Mapping[str, Any]

    def spec(self) -> ToolSpec:
        """The tool as the model's template receives it (OpenAI's shape)."""
        schema = dict(self.input_schema) or {"type": "object", "properties": {}}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": schema}}  # fmt: skip


@dataclass(frozen=True)
class ToolOutcome:
    ok: bool
    text: str  # the result for the model (untrusted text), or the failure in one line


@dataclass
class _Server:
    spec: ServerSpec
    session: Any = None
    tools: list[McpTool] = field(default_factory=list)
    error: str = ""  # why it is not usable; "" while starting or ready
    errlog: Any = None  # the server's stderr (a stdio server's last line explains a crash)
    closing: asyncio.Event = field(default_factory=asyncio.Event)  # set: the session ends
    task: asyncio.Task | None = None


class McpClient:
    """Start servers, list their tools, call one; safe to use from any thread but the client's own."""

    def __init__(self, settings: McpSettings) -> None:
        self.settings = settings
        self._servers: dict[str, _Server] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-client", daemon=True)
        self._thread.start()

    # ---- blocking API for the app's threads ----------------------------------------------------------

    def start(self) -> list[str]:
        """Start every configured server not already running (in parallel); one line per failure."""
        specs = [s for s in self.settings.servers if s.name not in self._servers or self._servers[s.name].error]
        if not specs:
            return []
        return self._run(self._start_all(specs), self.settings.start_timeout + 5)

    @property
    def tools(self) -> list[McpTool]:
        """Every tool of every ready server; a name offered twice is kept from the first server only."""
        seen: dict[str, McpTool] = {}
        for server in list(self._servers.values()):
            for tool in server.tools:
                seen.setdefault(tool.name, tool)
        return list(seen.values())

    def server_lines(self) -> list[str]:
        return [f"{s.spec.name}: " + (f"failed: {s.error}" if s.error else f"{len(s.tools)} tools")
                for s in self._servers.values()]  # fmt: skip

    def call(self, name: str, arguments: Mapping[str, Any], stop: threading.Event | None = None) -> ToolOutcome:
        """Run tool `name`; waits at most `timeout` seconds, and gives up early when `stop` is set."""
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            return ToolOutcome(False, f"no tool named {name!r}")
        future = asyncio.run_coroutine_threadsafe(self._call(tool, dict(arguments)), self._loop)
        while True:
            try:
                return future.result(timeout=0.05)
            except TimeoutError:
                if stop is not None and stop.is_set():
                    future.cancel()
                    return ToolOutcome(False, "stopped before the tool answered")

    def close(self) -> None:
        """End every session and server process, then the loop."""
        if not self._loop.is_running():
            return
        try:
            self._run(self._close_all(), 10)
        except Exception:
            pass  # closing is best effort: the processes die with the app anyway
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- on the loop --------------------------------------------------------------------------------

    async def _start_all(self, specs: list[ServerSpec]) -> list[str]:
        ready = []
        for spec in specs:
            server = _Server(spec, closing=asyncio.Event())
            self._servers[spec.name] = server
            started = asyncio.Event()
            server.task = asyncio.create_task(self._hold(server, started))
            ready.append((server, started))
        failures = []
        for server, started in ready:
            try:
                await asyncio.wait_for(started.wait(), self.settings.start_timeout)
            except TimeoutError:
                server.error = f"no answer in {self.settings.start_timeout:g} s"
                server.closing.set()
            if server.error:
                failures.append(f"MCP server {server.spec.name!r} did not start: {server.error}")
        return failures

    async def _hold(self, server: _Server, started: asyncio.Event) -> None:
        """Open the server's session, list its tools, and keep it open until `close`."""
        spec = server.spec
        try:
            async with AsyncExitStack() as stack:
                if spec.url:
                    from mcp.client.streamable_http import streamable_http_client

                    read, write = await stack.enter_async_context(streamable_http_client(spec.url))
                else:
                    from mcp.client.stdio import StdioServerParameters, stdio_client

                    server.errlog = tempfile.TemporaryFile("w+", encoding="utf-8")  # read by _why, then closed
                    params = StdioServerParameters(command=spec.command, args=list(spec.args),
                                                   env={**os.environ, **spec.env})  # fmt: skip
                    read, write = await stack.enter_async_context(stdio_client(params, errlog=server.errlog))
                from mcp import ClientSession

                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                listed = await session.list_tools()
                server.tools = [
                    McpTool(t.name, spec.name, (t.description or "").strip(), dict(t.input_schema or {}))
                    for t in listed.tools
                ]
                server.session = session
                started.set()
                await server.closing.wait()
        except BaseException as exc:  # noqa: BLE001 - any failure of a server is reported, never raised
            server.error = server.error or self._why(server, exc)
            server.session = None
            server.tools = []
            started.set()
            if server.errlog is not None:
                server.errlog.close()
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise

    def _why(self, server: _Server, exc: BaseException) -> str:
        """One line: the exception, or the server's own last stderr line when it has one."""
        last = ""
        if server.errlog is not None:
            try:
                server.errlog.seek(0)
                lines = [ln.strip() for ln in server.errlog.read().splitlines() if ln.strip()]
                last = lines[-1] if lines else ""
            except (OSError, ValueError):
                pass
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        if isinstance(exc, FileNotFoundError):
            return f"command not found: {server.spec.command}"
        text = describe_error(exc) if isinstance(exc, Exception) else type(exc).__name__
        return f"{text} ({last[:200]})" if last else text

    async def _call(self, tool: McpTool, arguments: dict[str, Any]) -> ToolOutcome:
        server = self._servers.get(tool.server)
        if server is None or server.session is None:
            why = server.error if server is not None else "not started"
            return ToolOutcome(False, f"MCP server {tool.server!r} is not running ({why})")
        try:
            result = await asyncio.wait_for(server.session.call_tool(tool.name, arguments), self.settings.timeout)
        except TimeoutError:
            return ToolOutcome(False, f"{tool.name} on {tool.server!r}: no answer in {self.settings.timeout:g} s")
        except Exception as exc:  # a crashed server, a broken pipe: one line, and the server is marked down
            if server.task is not None and server.task.done():
                return ToolOutcome(False, f"MCP server {tool.server!r} stopped: {server.error or describe_error(exc)}")
            return ToolOutcome(False, f"{tool.name} on {tool.server!r} failed: {self._why(server, exc)}")
        return _outcome(tool, result)

    async def _close_all(self) -> None:
        for server in self._servers.values():
            server.closing.set()
        tasks = [s.task for s in self._servers.values() if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5)


def _outcome(tool: McpTool, result: Any) -> ToolOutcome:
    """A CallToolResult as text for the model; an error or a result with no text part is a failure."""
    content = getattr(result, "content", None) or []
    texts = [c.text for c in content if getattr(c, "type", "") == "text"]
    others = sorted({getattr(c, "type", "?") for c in content if getattr(c, "type", "") != "text"})
    if getattr(result, "is_error", False):
        return ToolOutcome(False, f"{tool.name} raised: {' '.join(' '.join(texts).split())[:300] or 'no detail'}")
    if not texts:
        what = ", ".join(others) or "nothing"
        return ToolOutcome(False, f"{tool.name} returned {what}, not text; the chat passes only text to the model")
    return ToolOutcome(True, "\n".join(texts))
