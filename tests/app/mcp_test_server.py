"""A small stdio MCP server (the `mcp` SDK's MCPServer) whose tools fail on command, for the tool-loop tests.

Run: python tests/app/mcp_test_server.py [--fail-start] [--http PORT]   (--http: streamable HTTP on 127.0.0.1)
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.types import ImageContent

server = MCPServer("testtools")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two whole numbers."""
    return str(a + b)


@server.tool()
def long_text(lines: int) -> str:
    """Return that many numbered lines."""
    return "\n".join(f"line {i}" for i in range(1, lines + 1))


@server.tool()
def crash() -> str:
    """Exit the server process mid-call."""
    print("testtools: crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool()
def hang() -> str:
    """Never answer (sleeps for an hour)."""
    time.sleep(3600)
    return "late"


@server.tool()
def boom() -> str:
    """Raise an exception."""
    raise ValueError("boom on purpose")


@server.tool()
def picture() -> ImageContent:
    """Return an image, not text."""
    return ImageContent(type="image", data="iVBORw0KGgo=", mime_type="image/png")


if __name__ == "__main__":
    if "--fail-start" in sys.argv:
        print("testtools: refusing to start", file=sys.stderr, flush=True)
        sys.exit(2)
    if "--http" in sys.argv:
        server.run("streamable-http", port=int(sys.argv[sys.argv.index("--http") + 1]))
    else:
        server.run("stdio")
