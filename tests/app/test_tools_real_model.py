"""Tools end to end on the real Qwen2.5-Coder-1.5B and the real `mcp-server-time` from PyPI: the app driven by
Pilot (the call is approved with y), and `chatapp run --chat --mcp-config FILE --yes`. Greedy, with a system
prompt asking for a plain answer once a tool has answered (without it the 1.5B model tends to call again)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from chatapp.mcp.config import McpSettings, ServerSpec
from chatapp.tui.widgets.tool_call import ApprovalPrompt
from engine.sampling import SamplingSettings
from tests.app.fake_backend import record_notices, send, wait_for
from tests.reliability.support import PYTHON, REPO, child_env

SYSTEM = (
    "You are a helpful assistant. When a tool has answered, reply to the user in one plain sentence that states "
    "its result."
)
QUESTION = "What is the current time in Tokyo?"
TIME = ServerSpec("time", shutil.which("mcp-server-time") or "mcp-server-time", ("--local-timezone", "UTC"))


def hh_mm(result: str) -> str:
    """The hour and minute of mcp-server-time's answer ("2026-12-06T11:23:23+09:00" -> "11:23")."""
    return json.loads(result)["datetime"][11:16]

def time_config(folder: Path) -> Path:
    """An --mcp-config file in `folder` with the real mcp-server-time as "time"."""
    config = folder / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"time": {"command": TIME.command, "args": list(TIME.args)}}}))
    return config


def assert_the_tool_told_the_time(done: subprocess.CompletedProcess[str]) -> None:
    """`run --chat --mcp-config time --yes` listed the tools, called get_current_time for Tokyo unasked, and
    its answer states the time the tool returned."""
    assert done.returncode == 0, done.stderr
    assert "chatapp: 2 tools: get_current_time (time), convert_time (time)" in done.stderr
    assert re.search(r"chatapp: tool call: get_current_time on time .*Asia/Tokyo", done.stderr), done.stderr
    results = re.findall(r"tool result: get_current_time \(\d+ ms\): (\{.*\})", done.stderr)
    assert results and "run get_current_time" not in done.stderr  # --yes: nothing was asked
    assert hh_mm(results[-1]) in done.stdout, (done.stdout, results[-1])



async def test_the_app_calls_mcp_server_time_after_approval(qwen15_path: Path, tmp_path: Path):
    from chatapp.tui.app import ChatApp
    from engine import load_model
    from engine.chat import ChatSession

    app = ChatApp(
        lambda progress: ChatSession(load_model(qwen15_path, n_ctx=2048)),
        model_name="qwen2.5-coder-1.5b",
        settings=SamplingSettings(temperature=0.0, max_tokens=200),
        system_prompt=SYSTEM,
        mcp=McpSettings((TIME,)),
    )
    record_notices(app)
    async with app.run_test(size=(120, 50)) as pilot:
        await wait_for(pilot, lambda: app.backend is not None and app.status.tools == "2 tools", timeout=300)
        await send(pilot, QUESTION, wait=False)
        approvals = 0
        while app.generating:  # approve each call the model makes (y)
            if app.query(ApprovalPrompt) and app.focused is app.query_one(ApprovalPrompt):
                await pilot.press("y")
                approvals += 1
            await pilot.pause(0.1)
        reply = app.state.turns[-1]
    calls = [c for r in reply.rounds for c in r.calls]
    assert approvals >= 1 and calls and all(c.name == "get_current_time" and c.status == "ok" for c in calls)
    assert "Tokyo" in calls[-1].arguments
    assert hh_mm(calls[-1].result) in reply.content, (reply.content, calls[-1].result)


def test_run_chat_with_mcp_config_and_yes(qwen15_path: Path, tmp_path: Path):
    config = time_config(tmp_path)
    command = [PYTHON, "-m", "chatapp", "run", "--chat", "-m", str(qwen15_path), "-c", "2048", "--temp", "0",
               "-n", "200", "--system", SYSTEM, "--mcp-config", str(config), "--yes", "-p", QUESTION]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    assert_the_tool_told_the_time(done)
