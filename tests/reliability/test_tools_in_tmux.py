"""Tools in a real terminal: the app (scripted model, the tests' own stdio MCP server) runs inside tmux; the
screen shows the tool count, the call's block, the approval prompt, the result and the answer; the terminal
comes back as it was."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from chatapp.store import ConversationStore
from tests.reliability.support import PYTHON, REPO, child_env
from tests.reliability.test_quit_mid_reply import SHELL_MODES, Tmux


def test_a_tool_call_approved_in_a_real_terminal(tmp_path: Path) -> None:
    env = child_env(tmp_path)
    store_path = tmp_path / "chats.sqlite"
    variables = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("CHATAPP_CONFIG_DIR", "CHATAPP_DATA_DIR"))
    command = f"{variables} {PYTHON} -m tests.app.fake_backend --tools --store {shlex.quote(str(store_path))}"
    term = Tmux(tmp_path / "tmux.sock")
    try:
        term.type(f"cd {shlex.quote(str(REPO))} && PYTHONUNBUFFERED=1 {command}; echo EXIT=$?")
        term.wait_for(lambda s: "6 tools" in s, timeout=120, what="the MCP server's tools in the status line")
        term.type("What is 20 + 22?")
        # The prompt has the focus once the footer offers its keys.
        asking = term.wait_for(lambda s: "Allow once" in s, timeout=60, what="the focused approval prompt")
        assert "⚙ add · testtools" in asking and '"a": 20,' in asking and "waiting for your approval" in asking
        assert re.search(r"y once · a always in this chat · n/Esc deny", asking), asking
        term("send-keys", "-t", "rel", "y")
        done = term.wait_for(
            lambda s: "The tool says 20 + 22 = 42." in s and "1 tool round, 1 call" in s and "Run this" not in s,
            timeout=60,
            what="the answer, under the call's block, with the prompt gone",
        )
        assert "→ result" in done
        block = done[done.index("⚙ add · testtools") :]
        assert re.search(r"│\s+42\s+│", block), done  # the result line, inside the block
        term("send-keys", "-t", "rel", "C-q")
        screen = term.wait_for(lambda s: re.search(r"^EXIT=\d+$", s, re.M), timeout=60, what="the app to exit")
        assert "EXIT=0" in screen.splitlines() and "Traceback" not in screen, screen
        assert term.modes() == SHELL_MODES
    finally:
        term.kill()
    store, _ = ConversationStore.open(store_path)
    with store:
        (summary,) = store.list()
        _, reply = store.load(summary.id).messages
    assert reply.stats["tool_rounds"][0]["calls"][0]["result"] == "42"
