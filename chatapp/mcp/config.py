"""Which MCP servers to start: `[mcp]` in config.toml and `--mcp-config FILE` (the `mcpServers` JSON shape).

    [mcp]
    timeout = 30          # seconds a call may take
    start_timeout = 60    # seconds a server may take to start and list its tools
    max_rounds = 8        # tool rounds per reply before the model must answer
    allow = ["get_current_time"]   # tools that run without asking
    [mcp.servers.time]
    command = "mcp-server-time"
    args = ["--local-timezone", "UTC"]
    env = {}
    # or: url = "http://localhost:8000/mcp"  (streamable HTTP)

The JSON file holds `{"mcpServers": {"NAME": {...same keys...}}}`; its servers are added to the config's (a name
in both: the file's wins).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


class McpConfigError(ValueError):
    """A server or key that cannot be used; the text names it."""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: str = ""  # stdio: the program to start
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # added to the environment the program gets
    url: str = ""  # streamable HTTP: the server's endpoint

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"


@dataclass(frozen=True)
class McpSettings:
    servers: tuple[ServerSpec, ...] = ()
    allow: tuple[str, ...] = ()  # tool names that run without asking
    timeout: float = 30.0  # seconds one call may take
    start_timeout: float = 60.0  # seconds a server may take to start and list its tools
    max_rounds: int = 8  # tool rounds per reply


def server_from_table(name: str, table: Any, where: str) -> ServerSpec:
    """One server's keys (`command`/`args`/`env`, or `url`) checked; `where` starts each error message."""
    if not isinstance(table, Mapping):
        raise McpConfigError(f"{where}: server {name!r} must be a table, got {table!r}")
    unknown = set(table) - {"command", "args", "env", "url", "type", "transport"}
    if unknown:
        raise McpConfigError(f"{where}: server {name!r}: unknown key {sorted(unknown)[0]!r} "
                             "(expected command, args, env, or url)")  # fmt: skip
    command, url = table.get("command", ""), table.get("url", "")
    if not isinstance(command, str) or not isinstance(url, str):
        raise McpConfigError(f"{where}: server {name!r}: command and url must be strings")
    if bool(command.strip()) == bool(url.strip()):
        raise McpConfigError(f"{where}: server {name!r} needs either a command (stdio) or a url (streamable HTTP)")
    if url and not re.match(r"https?://[^/\s]+", url.strip()):
        raise McpConfigError(f"{where}: server {name!r}: url must start with http:// or https://, got {url!r}")
    args = table.get("args", [])
    if not isinstance(args, Sequence) or isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise McpConfigError(f"{where}: server {name!r}: args must be a list of strings")
    env = table.get("env", {})
    if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
        raise McpConfigError(f"{where}: server {name!r}: env must be a table of strings")
    return ServerSpec(name, command.strip(), tuple(args), dict(env), url.strip())


def settings_from_table(table: Any, where: str, base: McpSettings | None = None) -> McpSettings:
    """`[mcp]` over `base`: servers are added by name, the other keys replace."""
    base = base or McpSettings()
    if not isinstance(table, Mapping):
        raise McpConfigError(f"{where}: [mcp] must be a table")
    unknown = set(table) - {"servers", "allow", "timeout", "start_timeout", "max_rounds"}
    if unknown:
        raise McpConfigError(f"{where}: unknown key in [mcp]: {sorted(unknown)[0]!r} "
                             "(expected one of: servers, allow, timeout, start_timeout, max_rounds)")  # fmt: skip
    out = base
    for key in ("timeout", "start_timeout"):
        if key in table:
            seconds = table[key]
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
                raise McpConfigError(f"{where}: mcp.{key} must be a number of seconds > 0, got {seconds!r}")
            if key == "timeout":
                out = replace(out, timeout=float(seconds))
            else:
                out = replace(out, start_timeout=float(seconds))
    if "max_rounds" in table:
        rounds = table["max_rounds"]
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise McpConfigError(f"{where}: mcp.max_rounds must be a whole number >= 1, got {rounds!r}")
        out = replace(out, max_rounds=rounds)
    if "allow" in table:
        allow = table["allow"]
        if not isinstance(allow, list) or not all(isinstance(a, str) for a in allow):
            raise McpConfigError(f"{where}: mcp.allow must be a list of tool names")
        out = replace(out, allow=tuple(allow))
    servers = table.get("servers", {})
    if not isinstance(servers, Mapping):
        raise McpConfigError(f"{where}: [mcp.servers] must be a table of servers")
    return add_servers(out, [server_from_table(n, t, where) for n, t in servers.items()])


def add_servers(settings: McpSettings, servers: Sequence[ServerSpec]) -> McpSettings:
    """`settings` with `servers` added; one of the same name replaces the older."""
    named = {s.name: s for s in settings.servers} | {s.name: s for s in servers}
    return replace(settings, servers=tuple(named.values()))


def read_mcp_json(path: Path) -> list[ServerSpec]:
    """The servers of an `mcpServers` JSON file (Claude Desktop's, oterm's and Cursor's shape)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise McpConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise McpConfigError(f"{path}, line {exc.lineno}: not valid JSON: {exc.msg}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("mcpServers"), Mapping):
        raise McpConfigError(f'{path}: expected {{"mcpServers": {{"NAME": {{"command": ...}}}}}}')
    return [server_from_table(name, table, str(path)) for name, table in data["mcpServers"].items()]
