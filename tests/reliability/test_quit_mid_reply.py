"""Quitting the app while a reply streams: the terminal comes back as it was, the chat so far is saved.

The first test runs the real `chatapp` on the real SmolLM2 inside tmux, so the terminal is a real one whose
modes (alternate screen, mouse reporting, cursor) can be read back after the app has gone. The second pins down,
on the scripted backend, that the saved reply is exactly what was on screen.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chatapp.store import ConversationStore
from tests.app.fake_backend import FakeBackend, make_app, ready, send, wait_for
from tests.reliability.support import PYTHON, REPO, child_env

PROMPT = "Write a long story about a brave knight and a dragon."
# Terminal modes a full-screen app switches on and must switch off again; tmux reports them per pane.
MODES = ("alternate_on", "mouse_any_flag", "mouse_button_flag", "mouse_standard_flag", "mouse_sgr_flag", "cursor_flag")
SHELL_MODES = {"alternate_on": "0", "mouse_any_flag": "0", "mouse_button_flag": "0", "mouse_standard_flag": "0"}
SHELL_MODES |= {"mouse_sgr_flag": "0", "cursor_flag": "1"}


class Tmux:
    """One private tmux server (its own socket) with one 120×40 pane running a plain bash."""

    def __init__(self, socket: Path) -> None:
        tmux = shutil.which("tmux")
        assert tmux, "tmux is not installed; this test needs it to run the app in a real terminal"
        self.base = [tmux, "-S", str(socket), "-f", "/dev/null"]
        self("new-session", "-d", "-s", "rel", "-x", "120", "-y", "40", "bash --norc --noprofile")

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, check=True, timeout=30).stdout

    def type(self, text: str) -> None:
        self("send-keys", "-t", "rel", "-l", text)
        self("send-keys", "-t", "rel", "Enter")

    def screen(self) -> str:
        return self("capture-pane", "-t", "rel", "-p")

    def modes(self) -> dict[str, str]:
        values = self("display-message", "-t", "rel", "-p", " ".join(f"#{{{m}}}" for m in MODES)).split()
        return dict(zip(MODES, values, strict=True))

    def wait_for(self, found: Callable[[str], object], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if found(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; the pane shows:\n{screen}")
            time.sleep(0.2)

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)


def _words_streamed(screen: str) -> int:
    """Words in the reply box while it still says "generating…", else 0.

    Read from the reply itself, not the status line: the status line's right half is where toasts appear (on a
    machine that loads fast, the start-up notices are still up when the reply streams). Each word is at least
    one token."""
    lines = screen.splitlines()
    marker = next((i for i, line in enumerate(lines) if line.strip(" │") == "generating…"), None)
    if marker is None:
        return 0
    top = max(i for i in range(marker) if "╭─" in lines[i])  # the reply box's top border
    return sum(len(line.strip(" │").split()) for line in lines[top + 1 : marker])


@pytest.mark.slow
def test_ctrl_q_mid_reply_restores_the_terminal_and_keeps_the_chat(smollm2_path: Path, tmp_path: Path) -> None:
    env = child_env(tmp_path)
    variables = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("CHATAPP_CONFIG_DIR", "CHATAPP_DATA_DIR"))
    command = f"{PYTHON} -m chatapp -m {shlex.quote(str(smollm2_path))} -c 1024 --temp 0.8 --seed 7"
    term = Tmux(tmp_path / "tmux.sock")
    try:
        assert term.modes() == SHELL_MODES
        term.type(f"cd {shlex.quote(str(REPO))} && {variables} {command}; echo EXIT=$?")
        ready = term.wait_for(lambda s: "is ready." in s, timeout=300, what="the model to load")
        assert "smollm2-135m-instruct" in ready and "Lc100K" not in ready  # its catalog name, not the run's
        in_app = term.modes()
        assert in_app["alternate_on"] == "1" and in_app["mouse_sgr_flag"] == "1", in_app  # the test can tell

        term.type(PROMPT)
        term.wait_for(lambda s: _words_streamed(s) >= 5, timeout=120, what="the reply to stream")
        term("send-keys", "-t", "rel", "C-q")
        screen = term.wait_for(lambda s: re.search(r"^EXIT=\d+$", s, re.M), timeout=60, what="the app to exit")
        assert "EXIT=0" in screen.splitlines(), screen
        assert "Traceback" not in screen, screen
        assert term.modes() == SHELL_MODES, "the app left the terminal in another mode"
        assert term("display-message", "-t", "rel", "-p", "#{pane_current_command}").strip() == "bash"
        term.type("echo READY")
        term.wait_for(lambda s: "READY" in s.splitlines(), timeout=10, what="the shell to answer")
    finally:
        term.kill()

    store, _ = ConversationStore.open(Path(env["CHATAPP_DATA_DIR"]) / "conversations.db")
    with store:
        (summary,) = store.list()
        user, reply = store.load(summary.id).messages
    assert (user.role, user.content) == ("user", PROMPT)
    assert reply.role == "assistant" and reply.content.strip()
    # Saved at quit, not by the last progress write: the token list is there and adds up to the text.
    assert reply.stats is not None and "stop_reason" not in reply.stats
    assert len(reply.stats["tokens"]) >= 5
    assert "".join(t["text"] for t in reply.stats["tokens"]) == reply.content


async def test_quitting_mid_reply_saves_the_reply_as_shown(tmp_path: Path) -> None:
    backend = FakeBackend([" ".join(f"word{i}" for i in range(400))], token_delay=0.02)
    store, _ = ConversationStore.open(tmp_path / "chats.sqlite")
    app = make_app(backend, store=store)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "count", wait=False)
            await wait_for(pilot, lambda: len(app.state.turns[-1].tokens) >= 8, what="eight tokens")
            conv_id = app.state.conv_id
            await pilot.press("ctrl+q")
        shown = app.state.turns[-1]
        assert backend.cancel_calls >= 1
        saved = store.load(conv_id).messages
        assert [(m.role, m.content) for m in saved] == [("user", "count"), ("assistant", shown.content)]
        assert len(saved[1].stats["tokens"]) == len(shown.tokens) >= 8
    finally:
        store.close()
